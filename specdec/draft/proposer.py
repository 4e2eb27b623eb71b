"""Vanilla draft-model speculation: a separate small model on the same runtime proposes k tokens.

KV bookkeeping (per row, S = prompt + emitted tokens, len(S) = n): before proposing, the draft's
length is set to n - W and it ingests S[n-W:] in one W-token step, then k - 1 one-token steps follow.
W = 2 when every row's draft cache holds S[:n-2]: the step re-reads S[-2] (harmless: same KV) so rows
that accepted all k drafts last step — whose draft cache lacks the k-th draft token — and rows that
did not are handled by one fixed-shape step. That is always the case when the accepted tokens are
this draft's own proposals (it ingested each one when proposing it).

When they are not — another proposer's tokens were verified for the row (``LookupOrDraft``) — the
cache holds the draft's own tokens from the first one that differs. So the proposer tracks, on the
host, each row's sequence S (``seq``) and how many leading cache slots hold it (``synced``: after a
step, n + the length of the prefix of its drafts x_1 .. x_{k-1}, ingested at slots n .. n+k-2, that
equals the emitted tokens); W = max(2, the largest n - synced) then re-reads every stale slot of every
row (rows shorter than W start at slot 0; the slots past their length are overwritten later).

Deferred encoding ("deferred"): ``start`` only records a row's prompt; ``flush`` encodes it (one single-row
context graph: the prompt encoding's prefix cache applies) — the speculation step calls it before its first step
that speculates (outside the cost gate's timing: a once-a-request cost), a fused step at once (its graph runs the
draft's steps itself), and ``propose`` itself first. So a request's first token waits for the target's prompt
encoding only, and a request whose steps never speculate (the gate's plain steps: ``specdec.speculation.gate``)
never runs the draft.

A ``MatchOrDraft`` skips ``propose`` on greedy steps where every row takes its source's tokens ("resyncs"), and
the gate's plain steps skip it too: the stale span then grows past k + 1, and ``propose`` first catches up: a
span of at least the smallest context bucket in one single-row context graph (``DecoderModel.extend``, where the
backend compiles nothing per shape: ``shapes_free``), the rest in steps of k + 1 tokens (S[synced .. synced + k]
at slots synced .., the width a re-read after a source step already has) until it fits one. The tokens these
encodings sample are discarded, so their noise comes from no row's stream (``discard``): a row's random stream
does not depend on when its draft catches up.

Window (``window``, None: off): a row's draft never encodes more than ``window`` tokens at once. A deferred
prompt longer than that is encoded from its last ``window`` tokens, and a catch-up span longer than that restarts
the row's draft context at the last ``window`` tokens of S, in one context graph, instead of encoding the span.
The draft then holds S[base:] for a per-row ``base`` (slot j, at position j, holds S[base + j]; everything above
counts in slots, n - base for a row of length n) and proposes from that suffix of S: a shorter context, never a
wrong one. So what a request's first speculative step, and a probe of the cost gate after many plain steps, cost
is bounded by ``window`` tokens a row, however long the prompt or the run of plain steps was. Lossless (any
proposal is: the target verifies it); the acceptance is that of a draft reading only the tokens since ``base``.

Confidence stop (``p_min``, llama.cpp's ``--draft-p-min``, Hugging Face's ``assistant_confidence_threshold``):
a greedy row stops drafting after the first token x_i its draft gives a probability below p_min (softmax of
the draft's logits), keeping x_i; the step drafts while any row goes on, and the proposal says how many
drafts each row has (``Proposal.num_drafts``: "padded"), so the verify covers the longest row's drafts only
(``speculation.speculative.narrowed``). The greedy output is unchanged (greedy verification accepts the
target's own tokens); what changes is the cost: fewer draft steps and a narrower verify where the draft
doubts. Sampled rows stop the same way, on the top probability of the warped distribution a sampled row draws
from (llama.cpp's rule); the stop depends on the draft's side only, so the acceptance rule stays lossless (a
row's acceptance over its first d drafts is a d-draft step), and the noise of the draft steps not run is drawn
anyway (``DecoderModel.skip_draws``), so a row's random stream does not depend on when its neighbours stop.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from ..core.buckets import pick_bucket
from ..core.decoder import DecoderModel
from ..core.loading import AUTO
from ..core.named_models import draft_preset
from ..core.paths import gguf_source
from ..core.sampling import RowGenerators, any_sampled, greedy_rows
from ..fused.step import FusedKey
from ..speculation.proposer import BaseProposer, Proposal
from .fused import DraftLoop


class DraftModel(BaseProposer):
    """A small ``DecoderModel`` proposing for a target with the same tokenizer (a ``Proposer``): a chain
    proposer running the graphs of ``model``, which fuses (``fused_drafter``) and may skip steps ("resyncs").

    ``p_min`` (0 < p_min < 1, None: off): the confidence stop (module docstring). A draft with
    it declares "padded" instead of "fused_drafter" (a fused graph always drafts k). ``window`` (an int >= 1,
    None: off): the most tokens a row's draft encodes at once (module docstring); a windowed draft is unfused
    too (a fused graph reads the draft's cache at the target's positions)."""

    abilities = frozenset({"check_target", "fused_drafter", "model", "resyncs", "finished", "deferred"})

    def __init__(self, model: DecoderModel, p_min: float | None = None, window: int | None = None):
        if getattr(model.lm, "feature_size", None):
            raise ValueError("this is an EAGLE draft network: use EagleDraft.from_pretrained(path, target)")
        if p_min is not None and (isinstance(p_min, bool) or not isinstance(p_min, (int, float))
                                  or not 0 < p_min < 1):
            raise ValueError(f"p_min must be a probability in (0, 1) (None: draft k tokens), got {p_min!r}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be an int >= 1 (the most tokens a row's draft encodes at once; None: "
                             f"no limit), got {window!r}")
        self.p_min, self.window = p_min, window
        if p_min is not None:
            self.abilities = (DraftModel.abilities - {"fused_drafter"}) | {"padded"}
        elif window is not None:
            self.abilities = DraftModel.abilities - {"fused_drafter"}
        self.model, self.module = model, model.lm
        self.vocab_size, self.batch_size = model.vocab_size, model.batch_size
        self.seq = torch.zeros(model.batch_size, model.n_positions, dtype=torch.long)   # S per row (host)
        self.synced = torch.zeros(model.batch_size, dtype=torch.long)   # S[:synced] is known to the cache ...
        self.base = torch.zeros(model.batch_size, dtype=torch.long)     # ... from S[base], held at slot 0
        self.pending = torch.zeros(model.batch_size, dtype=torch.long)  # prompt tokens to encode (0: none)
        self.live = torch.zeros(model.batch_size, dtype=torch.bool)     # rows started and not finished
        self.discard = RowGenerators(model.batch_size, model.device)    # no streams: zero noise
        self.drafts: torch.Tensor | None = None    # the last proposal, until ``accepted`` reads it

    @classmethod
    def from_pretrained(cls, path: str | Path | None, target: DecoderModel, p_min: float | str | None = AUTO,
                        window: int | None = None, **overrides) -> DraftModel:
        """Load a draft checkpoint with the target's runtime settings (batch size, ``n_positions``,
        ``amp``, buckets, sampling config, backend, device, ``tp_degree``; the head layout is chosen for the
        draft's own heads, and it returns no EAGLE-3 feature layers) unless ``overrides`` (any
        ``DecoderModel.from_pretrained`` argument) say otherwise. A target's ``quantization="gguf"``
        (and ``prompt_weights``) applies to a GGUF draft; a checkpoint-directory draft then stays in ``amp``.
        ``p_min``: the confidence stop, ``window``: the longest encoding (``DraftModel``).

        A named draft model for a target on GGML blocks takes its preset (``named_models.draft_preset``) where
        ``quantization`` is not overridden and ``p_min`` is "auto" (the default): re-quantized to Q4_0 with the
        confidence stop 0.7, its fastest measured draft; "auto" is None (k drafts a step) for any other draft.
        A fused graph drafts k tokens: pass ``p_min=None`` for ``SpeculativeGenerator(..., fused=True)``."""
        preset = draft_preset(path, target.settings.quantization)
        if p_min == AUTO:
            p_min = preset.draft_p_min if preset is not None else None
        if preset is not None and "quantization" not in overrides:
            overrides["quantization"] = preset.draft_quantization
        settings = {**asdict(target.settings), "sampling": target.settings.sampling, "gqa_strategy": None,
                    "feature_layers": (), **overrides}     # (an EAGLE-3 head's target layers: not the draft's)
        if settings["backend"] != "compiled" and "autotune" not in overrides:
            settings["autotune"] = False         # tunes the compiled backend only
        if settings["quantization"] == "gguf" and gguf_source(path) is None:
            settings["quantization"] = None      # "gguf" keeps what a file stores: a checkpoint directory's floats
            if "prompt_weights" not in overrides:
                settings["prompt_weights"] = None    # (dense copies of GGML blocks: it has none)
        model = DecoderModel.from_pretrained(path, **settings)
        draft = cls(model, p_min, window)
        draft.check_target(target)
        return draft

    def check_target(self, target: DecoderModel) -> None:
        """ValueError when this draft cannot propose for ``target`` (device, tokenizer)."""
        m = self.model
        if m.device != target.device:
            raise ValueError(f"draft is on {m.device}, target on {target.device}: use one device")
        if same_tokenizer_files(Path(m.path), Path(target.path)):
            return      # (loading both tokenizers to compare their vocabularies: ~1 s each for Qwen's)
        dt, tt = _tokenizer_or_none(m), _tokenizer_or_none(target)
        if dt is not None and tt is not None and dt.get_vocab() != tt.get_vocab():
            raise ValueError(f"draft tokenizer ({m.path}) differs from the target's ({target.path}): "
                             "same vocab size but different token ids")

    def start(self, rows, prompts, params, rng, target_out) -> None:
        # a draft proposes without the repetition penalty (the acceptance rule still makes the output the
        # target's penalised distribution), also when its model ran as a target before and tracked presence
        self.model.presence = None
        for p in prompts:       # (encoded later: refuse now what the draft's buckets cannot hold)
            pick_bucket(self.model.context_buckets, len(p), "the draft's prompt length")
        first = target_out.tokens[:, -1].cpu()
        if rows is None:
            self.synced.zero_()
            self.base.zero_()
            self.pending.zero_()
            self.live.zero_()
        for i, (r, p) in enumerate(zip(range(len(prompts)) if rows is None else rows, prompts)):
            self.seq[r, :len(p)] = torch.as_tensor(p)
            self.seq[r, len(p)] = first[i]
            self.synced[r], self.base[r], self.pending[r], self.live[r] = 0, 0, len(p), True

    def flush(self, params) -> None:
        """Encode the prompts ``start`` deferred (the module docstring), each in a single-row context graph
        (its last ``window`` tokens at most)."""
        for r in self.pending.nonzero().flatten().tolist():
            self._restart(r, int(self.pending[r]), params)
            self.pending[r] = 0

    def _restart(self, row: int, end: int, params) -> None:
        """Encode S[:end] of ``row`` afresh (its last ``window`` tokens at most) in one single-row context graph."""
        base = 0 if self.window is None else max(end - self.window, 0)
        self.model.prefill([self.seq[row, base:end]], params, self.discard, rows=[row])
        self.base[row], self.synced[row] = base, end

    def max_draft_tokens(self, length: int) -> int:
        return self.model.n_positions - length + 1

    def propose(self, tail, lengths, k, params, rng) -> Proposal:
        m = self.model
        sampled = any_sampled(params)
        n = lengths.cpu()
        self.catch_up(n, k + 1, params)
        width = max(2, int((n - self.synced).max()))           # re-read every row's stale slots
        local = (n - self.base).clamp(min=1)      # the rows' lengths in the draft's cache (a finished row's: any)
        start = (local - width).clamp(min=0)
        pos = (self.base + start).unsqueeze(1) + torch.arange(width)
        m.set_lengths(start)
        out = m.step(self.seq.gather(1, pos.clamp(max=self.seq.shape[1] - 1)), params, rng, advance=False,
                     return_probs=sampled)
        last = (local - 1 - start).to(out.tokens.device)         # S[-1]'s column: width - 1 unless n < width
        rows = torch.arange(len(last), device=last.device)
        tokens = [out.tokens[rows, last]]
        probs = [out.probs[rows, last]] if sampled else []
        num = None      # drafts per row (the confidence stop; None: k)
        if self.p_min is not None:
            num = self._stopped(torch.full_like(n, k), out.logits[rows, last], probs[0] if sampled else None,
                                params, 1, k)
        m.set_lengths(local)
        for i in range(2, k + 1):
            if num is not None and bool((num < k).all()):      # every row has stopped
                if sampled:     # the noise of the steps not run: each row's stream moves as if they had
                    for _ in range(i, k + 1):
                        m.skip_draws(rng, 1)
                break
            out = m.step(tokens[-1].unsqueeze(1), params, rng, return_probs=sampled)
            tokens.append(out.tokens[:, -1])
            if sampled:
                probs.append(out.probs[:, -1])
            if num is not None:
                num = self._stopped(num, out.logits[:, -1], probs[-1] if sampled else None, params, i, k)
        self.drafts = torch.stack(tokens, 1)
        if num is None:
            return Proposal(self.drafts, torch.stack(probs, 1) if sampled else None)
        pad = k - self.drafts.shape[1]      # positions past every row's stop: never verified (num_drafts)
        q = torch.stack(probs + probs[-1:] * pad, 1) if sampled else None
        return Proposal(torch.cat([self.drafts, self.drafts[:, -1:].expand(-1, pad)], 1), q, num_drafts=num)

    def _stopped(self, num: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor | None, params: torch.Tensor,
                 i: int, k: int) -> torch.Tensor:
        """Drafts per row [B] after the i-th draft x_i: a row still drafting (num = k) stops at i when the
        draft's confidence is below ``p_min`` — a greedy row's top probability under its ``logits`` [B, V]
        (softmax at the argmax x_i), a sampled row's top probability under the warped distribution ``probs``
        [B, V] it drew x_i from (llama.cpp's rule)."""
        top = 1.0 / torch.exp(logits - logits.max(-1, keepdim=True).values).sum(-1)    # softmax at the argmax
        if probs is not None:
            top = torch.where(greedy_rows(params).to(top.device), top, probs.amax(-1).to(top.device))
        return torch.where((num == k) & (top.cpu() < self.p_min), i, num)

    def catch_up(self, n: torch.Tensor, most: int, params) -> None:
        """Bring every row of length n [B] to at most ``most`` stale slots (steps whose ``propose`` was skipped):
        encode the deferred prompts (``flush``), restart a live row whose stale span is longer than ``window`` at
        S[n - 1 - window : n - 1], encode a live row's stale span of at least the smallest context bucket in one
        context graph (``shapes_free`` backends), then ingest S[synced ..] in steps of ``most`` tokens; a row
        re-reads from at most slot n_positions - most, and what a step writes past a row's S is overwritten before
        it is read (the draft steps after S[-1])."""
        m = self.model
        self.flush(params)
        span = n - 1 - self.synced          # S[synced : n - 1]: what a wide encoding takes
        if self.window is not None:
            for r in ((span > max(self.window, most)) & self.live).nonzero().flatten().tolist():
                self._restart(r, int(n[r]) - 1, params)
            span = n - 1 - self.synced
        wide = (span >= most) & (span >= m.context_buckets[0]) & self.live & m.shapes_free
        for r in wide.nonzero().flatten().tolist():
            base, held = int(self.base[r]), int(self.synced[r] - self.base[r])
            if m.can_extend(held, int(span[r])):
                m.extend(r, self.seq[r, base:int(n[r]) - 1], held, params, self.discard)
                self.synced[r] = n[r] - 1
        while int((n - self.synced).max()) > most:
            start = (self.synced - self.base).clamp(0, m.n_positions - most)      # slots
            pos = ((self.base + start).unsqueeze(1) + torch.arange(most)).clamp(max=self.seq.shape[1] - 1)
            m.set_lengths(start)
            m.step(self.seq.gather(1, pos), params, self.discard, advance=False, return_probs=any_sampled(params))
            self.synced = torch.minimum(self.base + start + most, n)

    def accepted(self, lengths, verified) -> None:
        """Record the emitted tokens in ``seq`` and which cache slots hold S (see the module docstring)."""
        n, a = lengths.cpu(), verified.num_accepted.cpu()
        emitted = verified.emitted.cpu()
        j = torch.arange(emitted.shape[1])
        pos = n.unsqueeze(1) + j
        keep = (j <= a.unsqueeze(1)) & (pos < self.seq.shape[1])
        self.seq[torch.arange(len(n)).unsqueeze(1).expand_as(pos)[keep], pos[keep]] = emitted[keep]
        if self.drafts is not None:   # slots n-1 .. (S[-1], then x_1 .. x_{k-1}) were written by propose
            ingested = self.drafts.cpu()[:, :-1]
            w = min(ingested.shape[1], emitted.shape[1])    # (a narrowed verify emits fewer: the rest is unverified)
            same = (ingested[:, :w] == emitted[:, :w]).long()
            self.synced = n + same.cumprod(1).sum(1)
            self.drafts = None

    def finished(self, rows, lengths=None) -> None:
        """A request ended: its row's draft cache holds the KV of S[base:synced] (kept for the row's next prompt
        when the draft caches prefixes: ``DecoderModel.keep_prefix``)."""
        self.pending[list(rows)], self.live[list(rows)] = 0, False
        if self.model.prefix_cache:
            for r in rows:
                self.model.keep_prefix(r, self.seq[r, int(self.base[r]):int(self.synced[r])].tolist())
        self.base[list(rows)] = 0     # the engine's placeholder lengths of finished rows count from slot 0

    def fused_drafter(self, key: FusedKey) -> DraftLoop:
        """``propose``'s k steps as one module for fused speculation (``specdec.fused``)."""
        return DraftLoop(self.module, key, self.model.settings.sampling.global_topk)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model")
"""The files a Hugging Face tokenizer is read from."""


def same_tokenizer_files(a: Path, b: Path) -> bool:
    """Whether checkpoint directories ``a`` and ``b`` hold a ``tokenizer.json`` and the same tokenizer files, byte
    for byte (then their tokenizers map every token to the same id)."""
    if not (a / "tokenizer.json").is_file():
        return False
    for name in TOKENIZER_FILES:
        fa, fb = a / name, b / name
        if fa.is_file() != fb.is_file() or (fa.is_file() and fa.read_bytes() != fb.read_bytes()):
            return False
    return True


def _tokenizer_or_none(model: DecoderModel):
    try:
        return model.tokenizer
    except (OSError, ValueError):
        return None
