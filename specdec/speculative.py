"""``SpeculativeGenerator``: the speculation loop shared by every strategy.

Convention: ``k`` = draft tokens proposed per step; the target verifies k + 1 positions (the k
drafts and the bonus / correction token), so a step emits between 1 and k + 1 tokens.
(transformers-neuronx's ``speculation_length`` counts verified tokens, i.e. our k + 1.)

One step, per row (S = prompt + emitted tokens, the target's cache holds S[:-1]):
  1. the proposer proposes x_1..x_k continuing S;
  2. the target runs one multi-token graph over [S[-1], x_1..x_k] at slots len(S)-1 .. len(S)+k-1,
     returning its (warped) distributions p_0..p_k;
  3. ``specdec.acceptance.accept`` keeps the longest accepted prefix x_1..x_n and draws the
     correction / bonus token (greedy: exact match with the argmax; sampled: lossless rejection);
  4. the target's length moves to len(S) + n (rollback of rejected slots is just that);
     the n + 1 new tokens are appended, cut at EOS / stopping criteria / the row's budget.
With a ``MedusaDraft`` steps 1-3 are one tree step instead (``specdec.medusa.draft``: a token tree
verified in one forward with the tree mask, the accepted path's KV rows compacted, the next
candidates read from the same forward); step 4 is shared.
Rows finish independently; finished rows stay in the fixed-shape batch but their output is frozen.
Near ``n_positions`` the step's k shrinks so no graph writes past the cache; at k = 0 a step is a
plain decode step.
"""
from __future__ import annotations

import time

import torch

from .acceptance import accept
from .core.decoder import DecoderModel
from .core.generation import format_output, prepare_request, stop_requested
from .core.parallel import broadcast
from .draft.proposer import DraftModelProposer
from .eagle.draft import EagleDraft
from .eagle.proposer import EagleProposer
from .medusa.draft import MedusaDraft
from .proposer import Proposer
from .stats import SpecStats


def check_compatible(draft, target: DecoderModel) -> None:
    """Raise ValueError when a draft model cannot propose for ``target``."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft vocab_size={draft.vocab_size} != target vocab_size={target.vocab_size}: "
                         "draft and target must share the tokenizer")
    if draft.batch_size != target.batch_size:
        raise ValueError(f"draft batch_size={draft.batch_size} != target batch_size={target.batch_size}: "
                         "compile both for the same batch size")
    if isinstance(draft, EagleDraft):
        if draft.config.hidden_size != target.config.hidden_size or draft.n_positions < target.n_positions:
            raise ValueError(f"EAGLE draft (hidden {draft.config.hidden_size}, n_positions {draft.n_positions}) "
                             f"does not fit the target (hidden {target.config.hidden_size}, n_positions "
                             f"{target.n_positions}): load it with EagleDraft.from_pretrained(path, target)")
        if draft.dtype != target.dtype:
            raise ValueError(f"EAGLE draft runs in {draft.dtype} but the target in {target.dtype}: "
                             "load it with EagleDraft.from_pretrained(path, target)")
    if isinstance(draft, DecoderModel):
        if draft.device != target.device:
            raise ValueError(f"draft is on {draft.device}, target on {target.device}: use one device")
        dt, tt = _tokenizer_or_none(draft), _tokenizer_or_none(target)
        if dt is not None and tt is not None and dt.get_vocab() != tt.get_vocab():
            raise ValueError(f"draft tokenizer ({draft.path}) differs from the target's ({target.path}): "
                             "same vocab size but different token ids")


def as_proposer(draft):
    """The proposer for a draft: EAGLE drafts and draft models are wrapped, proposers pass through."""
    if isinstance(draft, EagleDraft):
        return EagleProposer(draft)
    if isinstance(draft, DecoderModel):
        return DraftModelProposer(draft)
    return draft


def _tokenizer_or_none(model: DecoderModel):
    try:
        return model.tokenizer
    except (OSError, ValueError):
        return None


class SpeculativeGenerator:
    """Speculative decoding of ``target`` with ``draft`` proposing ``k`` tokens per step.

    ``draft``: a ``DecoderModel`` (vanilla draft model), an ``EagleDraft``, any
    ``specdec.proposer.Proposer``, or a ``MedusaDraft`` (a token tree verified in one forward; ``k`` is
    then the tree's depth and may be left out — see ``specdec.medusa.draft``).
    ``stats`` accumulates over calls; ``last_stats`` holds the latest call's numbers.
    """

    def __init__(self, draft: DecoderModel | Proposer | MedusaDraft, target: DecoderModel, k: int | None = None):
        self.tree = isinstance(draft, MedusaDraft)
        if self.tree:
            if draft.target is not target:
                raise ValueError("this MedusaDraft was loaded for another target: "
                                 "use MedusaDraft.from_pretrained(path, target)")
            if k is not None and k != draft.depth:
                raise ValueError(f"k={k!r} but a Medusa step drafts the tree's depth {draft.depth}: "
                                 "leave k out (choose the tree instead)")
            k = draft.depth
        elif k is None:
            raise ValueError("k (draft tokens per step) is required for a draft model or proposer")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"k must be an integer >= 0 (draft tokens per step), got {k!r}")
        if k + 1 > target.kv_buckets[-1] or k + 1 > target.n_positions - 1:
            raise ValueError(f"k={k} is too large: a verify step needs k+1={k + 1} slots but the target's "
                             f"largest KV bucket is {target.kv_buckets[-1]} (n_positions={target.n_positions})")
        if not self.tree:
            check_compatible(draft, target)
        self.proposer = draft if self.tree else as_proposer(draft)
        if not self.tree and not isinstance(self.proposer, Proposer):
            raise TypeError(f"draft must be a DecoderModel, a MedusaDraft or implement specdec.proposer.Proposer, "
                            f"got {type(draft)}")
        self.target, self.k = target, k
        self.stats = SpecStats()
        self.last_stats = SpecStats()

    def sample(self, input_ids, attention_mask=None, *, sequence_length: int | None = None,
               max_new_tokens: int | None = None, do_sample: bool | None = None, temperature=None,
               top_k=None, top_p=None, eos_token_id=None, pad_token_id: int | None = None,
               streamer=None, stopping_criteria=None, seed: int | None = None) -> torch.Tensor:
        """Generate like ``DecoderModel.generate`` (same arguments and output format) — the output
        distribution is exactly the target's; greedy output is token-for-token the target's."""
        target = self.target
        req = prepare_request(target, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                              sequence_length=sequence_length, do_sample=do_sample, temperature=temperature,
                              top_k=top_k, top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                              seed=seed)
        prompts, budget, params, eos, pad_token_id, generator = (
            req.prompts, req.budget, req.params, req.eos, req.pad_token_id, req.generator)
        greedy = bool((params[:, 2] <= 0).all())
        greedy_rows = (params[:, 2] <= 0).to(target.device)
        b, B = len(prompts), target.batch_size
        stats = SpecStats()
        start = time.perf_counter()

        target.reset()
        out = target.prefill(prompts, params, generator)
        seqs = [p.tolist() for p in prompts] + [[0, 0] for _ in range(B - b)]
        first = out.tokens[:, -1].cpu()
        new_tokens: list[list[int]] = [[] for _ in range(b)]
        active = torch.zeros(B, dtype=torch.bool)
        active[:b] = True
        if streamer is not None:
            streamer.put(format_output(input_ids, attention_mask, prompts, [[]] * b, pad_token_id))
        self._emit(first.unsqueeze(1), torch.zeros(B, dtype=torch.long), seqs, new_tokens, active, budget, eos,
                   stopping_criteria, streamer, (input_ids, attention_mask, prompts, pad_token_id))
        with stats.timer("draft"):
            if self.tree:
                self.proposer.start(prompts, out)
            else:
                self.proposer.start(prompts, params, generator, out)
        while bool(active.any()):
            lengths = torch.tensor([len(s) if active[i] else 2 for i, s in enumerate(seqs)])
            tail = torch.tensor([s[-2:] for s in seqs])
            if self.tree:
                n, emitted, k = self.proposer.step(tail[:, 1], lengths, params, generator, greedy, stats)
            else:
                n, emitted, k = self._chain_step(tail, lengths, params, generator, greedy, greedy_rows, stats)
            with stats.timer("other"):
                target.set_lengths(torch.where(active, lengths + n, lengths - 1))
                was_active = active.clone()
                appended = self._emit(emitted, n, seqs, new_tokens, active, budget, eos, stopping_criteria,
                                      streamer, (input_ids, attention_mask, prompts, pad_token_id))
                stats.update(n, k, active=was_active, emitted=appended)
        if streamer is not None:
            streamer.end()
        stats.add_time(other_s=time.perf_counter() - start - stats.total_s)
        self.last_stats = stats
        self.stats = self.stats + stats
        return format_output(input_ids, attention_mask, prompts, new_tokens, pad_token_id)

    def _chain_step(self, tail, lengths, params, generator, greedy, greedy_rows, stats):
        """One chain step (module docstring, 1-3 and the proposer's update) → (num_accepted [B],
        emitted [B, k+1], k). The target's length is left at len(S) - 1."""
        target = self.target
        k = max(0, min(self.k, target.n_positions - int(lengths.max()),
                       self.proposer.max_draft_tokens(int(lengths.max()))))
        with stats.timer("draft"):
            proposal = self.proposer.propose(tail, lengths, k, params, generator) if k else None
        with stats.timer("verify"):
            target.set_lengths(lengths - 1)
            drafts = proposal.tokens.cpu() if k else torch.zeros(target.batch_size, 0, dtype=torch.long)
            verify = target.step(torch.cat([tail[:, 1:], drafts], 1), params, generator,
                                 advance=False, return_probs=not greedy)
        with stats.timer("other"):
            n, emitted = accept(drafts.to(target.device), None if greedy else verify.probs,
                                None if proposal is None else proposal.probs,
                                target_tokens=verify.tokens, greedy_rows=greedy_rows, generator=generator)
            # rank 0 decides for every rank of a sharded target: the ranks stay in lockstep
            n, emitted = broadcast(n, target.tp).cpu(), broadcast(emitted, target.tp).cpu()
            self.proposer.accepted(lengths, n, emitted, verify)
        return n, emitted, k

    @staticmethod
    def _emit(emitted, num_accepted, seqs, new_tokens, active, budget, eos, stopping_criteria, streamer, fmt):
        """Append the n+1 emitted tokens of each active row one position at a time, so EOS, the
        budget and stopping criteria cut the run exactly where target-only decoding would stop.
        Returns the number of tokens appended per row [B]."""
        b = len(new_tokens)
        eos_set = set(eos.tolist())
        appended = torch.zeros(len(seqs), dtype=torch.long)
        for j in range(emitted.shape[1]):
            rows = [i for i in range(b) if active[i] and j <= int(num_accepted[i])]
            if not rows:
                break
            for i in rows:
                token = int(emitted[i, j])
                seqs[i].append(token)
                new_tokens[i].append(token)
                appended[i] += 1
                if token in eos_set or len(new_tokens[i]) >= int(budget[i]):
                    active[i] = False
            if streamer is not None:
                streamer.put(torch.tensor([new_tokens[i][-1] for i in rows]))
            if stopping_criteria:
                stop = stop_requested(stopping_criteria, format_output(*fmt[:3], new_tokens, fmt[3]))
                active[:b] &= ~stop
        return appended
