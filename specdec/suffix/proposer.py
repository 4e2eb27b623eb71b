"""``SuffixDraft`` / ``SuffixChain``: suffix decoding (SuffixDecoding, Oliaro et al., arXiv 2411.04975).

Training-free drafts from text seen before. Per row r, S = prompt + emitted tokens; each step:

  1. lookups: S's longest suffix match in the row's own ``SuffixIndex`` (prompt + output so far) and in
     the global ``SuffixCache`` (finished requests' outputs, optionally prompts, shared by every row
     and request), each giving the occurrences of that suffix (at most ``max_candidates``, latest first);
  2. for each source, ``speculate``: the count trie of what followed the occurrences, a token tree of
     the most frequent continuations (empirical probabilities as scores, at least ``min_prob``) within
     the budget max_spec = min(num_nodes, floor(alpha · match_length + offset)), best over the
     candidates' match lengths; the source whose draft scores higher (sum of probabilities) wins;
  3. the tree goes to ``TreeVerifier`` (one target forward over the root and ``num_nodes`` nodes). The
     shape is static: a row's unused slots (all of them when nothing matched) are children of the root
     repeating S[-1], marked padding (``tree.row_trees``: never accepted, and not computed by kernels that
     skip padding, so a step costs the verify of its real nodes there).

``SuffixChain`` proposes the most frequent path instead (k tokens, padded with S[-1]) for the chain
machinery: ``ChainVerifier``, adaptive k, combinations with a chain model draft.

Proposals are deterministic functions of S and the cache's state before the step (probs None): greedy
rows take the deepest path matching the target argmax (target-only greedy output); sampled rows use
the one-hot rules (tree: recursive multi-draft rejection; chain: accept x with p(x)): lossless.

Finished requests enter the global cache when the proposer learns a row is over: ``finished(rows,
lengths)`` (the engine calls it when a request ends, with its final length, which cuts what a final step
emitted past an EOS), or, for a loop that does not call it, the first step the row is no longer active (its
length or tail stops matching the row's sequence) or the row's next ``start`` — whichever comes first, once
per request.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from ..core.decoder import DecoderModel
from ..speculation.proposer import BaseProposer, Proposal, Verified
from ..speculation.tree import row_trees
from ..speculation.verify import TreeVerifier
from .cache import SuffixCache
from .index import SuffixIndex
from .speculate import Draft, speculate


class SuffixProposer(BaseProposer):
    """What ``SuffixDraft`` (trees) and ``SuffixChain`` (chains) share: per-row sequences and indexes,
    the global cache, lookups (``drafts``) and the cache's updates.

    ``cache``: the global ``SuffixCache`` (None: a private one); share one between proposers to share
    what they learn. ``cache_prompts``: cache a finished request's prompt with its output.
    ``running`` [B] bool: the row runs a request not yet added to the cache (``finished`` adds it).
    After each ``propose``: ``matched`` [B] long, the match length behind each row's draft (0: none);
    ``drafted`` [B] long, its real tokens (the rest is padding); ``from_cache`` [B] bool, whether the
    global cache (not the row's own sequence) gave it. Declares "finished" (the engine's hook: a finished
    request enters the cache) and "cache"."""

    abilities = frozenset({"finished", "cache"})

    def __init__(self, target: DecoderModel, cache: SuffixCache | None = None, *, max_nodes: int,
                 alpha: float = 1.0, offset: float = 0.0, min_prob: float = 0.1, cache_prompts: bool = False):
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
            raise ValueError(f"the node budget must be an int >= 1, got {max_nodes!r}")
        if not alpha > 0:
            raise ValueError(f"alpha must be > 0 (max_spec = alpha * match_length + offset), got {alpha!r}")
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must lie in [0, 1], got {min_prob!r}")
        self.target, self.cache = target, SuffixCache() if cache is None else cache
        self.max_nodes, self.alpha, self.offset, self.min_prob = max_nodes, alpha, offset, min_prob
        self.cache_prompts = cache_prompts
        self.vocab_size, self.batch_size = target.vocab_size, target.batch_size
        B = target.batch_size
        self.local = [self._index() for _ in range(B)]      # each row's own S (sequence id 0)
        self.prompt_len = [0] * B
        self.running = [False] * B                          # a request runs (its sequence is not cached yet)
        self.matched = torch.zeros(B, dtype=torch.long)
        self.drafted = torch.zeros(B, dtype=torch.long)
        self.from_cache = torch.zeros(B, dtype=torch.bool)

    def _index(self) -> SuffixIndex:
        c = self.cache
        index = SuffixIndex(c.keys, c.max_match, c.max_candidates)
        index.add(0, [])
        return index

    def seq(self, row: int) -> array:
        """Row ``row``'s sequence S as the proposer knows it (prompt + emitted tokens; an ``array("i")``)."""
        return self.local[row].seqs[0]

    # ------------------------------------------------------------------ rows starting and finishing
    def start(self, rows, prompts, params, rng, target_out) -> None:
        if rows is None:                                     # every row restarts
            self.finished(range(self.batch_size))
            rows = range(len(prompts))
        first = target_out.tokens[:, -1].tolist()
        for i, (r, prompt) in enumerate(zip(rows, prompts)):
            self.finished([r])
            self.local[r] = self._index()
            self.local[r].extend(0, prompt.tolist() + [first[i]])
            self.prompt_len[r], self.running[r] = len(prompt), True

    def finished(self, rows: Sequence[int], lengths: Sequence[int] | None = None) -> None:
        """The requests in ``rows`` are over (EOS, budget, released): add their sequences to the global
        cache (the output, with the prompt if ``cache_prompts``), cut to ``lengths`` (each row's final
        len(S), where the engine stopped it; None: all the tokens seen). Rows already added are skipped,
        so an engine may call this as often as it likes."""
        for i, r in enumerate(rows):
            if self.running[r]:
                self.running[r] = False
                seq = self.seq(r) if lengths is None else self.seq(r)[:lengths[i]]
                self.cache.add(seq if self.cache_prompts else seq[self.prompt_len[r]:])

    def _live(self, lengths: list[int], tail: list[list[int]] | None = None) -> list[bool]:
        """Which rows run a request the proposer tracks; a row that stopped matching has finished."""
        live = []
        for r, n in enumerate(lengths):
            seq = self.seq(r)
            ok = self.running[r] and len(seq) == n and (tail is None or seq[-2:].tolist() == tail[r])
            if self.running[r] and not ok:
                self.finished([r])
            live.append(ok)
        return live

    def accepted(self, lengths, verified: Verified) -> None:
        n = verified.num_accepted.tolist()
        emitted = verified.emitted.tolist()
        for r, live in enumerate(self._live(lengths.tolist())):
            if live:
                self.local[r].extend(0, emitted[r][:n[r] + 1])

    # ------------------------------------------------------------------ lookups
    def drafts(self, tail: torch.Tensor, lengths: torch.Tensor, depth: int, max_nodes: int, tree: bool) -> list[Draft]:
        """Each row's best draft (an empty ``Draft`` for rows without a match or not running), from its
        own sequence or the global cache; sets ``matched``, ``drafted`` and ``from_cache``."""
        live = self._live(lengths.tolist(), tail.tolist())
        out = []
        kw = dict(alpha=self.alpha, offset=self.offset, min_prob=self.min_prob, tree=tree)
        for r, ok in enumerate(live):
            best, cached = Draft(), False
            if ok:
                seq = self.seq(r)
                best = speculate(self.local[r].candidates(seq), depth, max_nodes, periodic=True, **kw)
                shared = speculate(self.cache.candidates(seq[-self.cache.max_match:]), depth, max_nodes, **kw)
                if shared.score > best.score:
                    best, cached = shared, True
            out.append(best)
            self.matched[r], self.drafted[r], self.from_cache[r] = best.match_len, len(best.tokens), cached
        return out

    def max_draft_tokens(self, length: int) -> int:
        return self.target.n_positions

    def step_drafts(self, tail: torch.Tensor, lengths: torch.Tensor, k: int) -> list[Draft]:
        """Each row's draft for a step of ``k`` (what ``propose`` verifies): a tree or a chain, per subclass."""
        raise NotImplementedError


class SuffixDraft(SuffixProposer):
    """Suffix decoding with token trees for ``target``: a tree proposer (k = ``depth``) verifying
    ``num_nodes`` nodes + the root per step with ``TreeVerifier``. See the module docstring and
    ``SuffixProposer`` for ``cache``, ``alpha``, ``offset``, ``min_prob``, ``cache_prompts``."""

    abilities = SuffixProposer.abilities | {"depth", "verifier", "verify_size", "check_target"}

    def __init__(self, target: DecoderModel, cache: SuffixCache | None = None, *, depth: int = 8,
                 num_nodes: int = 8, alpha: float = 1.0, offset: float = 0.0, min_prob: float = 0.1,
                 cache_prompts: bool = False):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {depth!r}")
        super().__init__(target, cache, max_nodes=num_nodes, alpha=alpha, offset=offset, min_prob=min_prob,
                         cache_prompts=cache_prompts)
        self.depth, self.num_nodes = depth, num_nodes
        self.verify_size = num_nodes + 1
        self.verifier = TreeVerifier()

    def check_target(self, target: DecoderModel) -> None:
        largest = min(target.kv_buckets[-1], target.n_positions - 1)
        if self.verify_size > largest:
            raise ValueError(f"SuffixDraft num_nodes={self.num_nodes} needs {self.verify_size} verify slots but "
                             f"the target allows {largest} (largest KV bucket {target.kv_buckets[-1]}, "
                             f"n_positions {target.n_positions})")

    def max_draft_tokens(self, length: int) -> int:
        """The depth while the N + 1 verify slots (and positions up to the depth) fit, else 0 (decode)."""
        return self.depth if length + max(self.num_nodes, self.depth) <= self.target.n_positions else 0

    def step_drafts(self, tail: torch.Tensor, lengths: torch.Tensor, k: int) -> list[Draft]:
        """Each row's tree: at most ``num_nodes`` nodes, min(k, depth) levels."""
        return self.drafts(tail, lengths, min(k, self.depth), self.num_nodes, tree=True)

    def propose(self, tail, lengths, k, params, rng) -> Proposal:
        """tokens [B, N] (node order, pads = S[-1] below the root, marked padding: not computed where kernels skip
        padding, never accepted) and the rows' trees (depth <= D, at most N children per node), built on the
        target's device."""
        N, B = self.num_nodes, self.batch_size
        drafts = self.step_drafts(tail, lengths, k)
        last = tail[:, 1].tolist()
        tokens = [d.tokens + [last[r]] * (N - len(d.tokens)) for r, d in enumerate(drafts)]
        parent = [[0] + d.parents + [0] * (N - len(d.tokens)) for d in drafts]
        real = [[True] * (1 + len(d.tokens)) + [False] * (N - len(d.tokens)) for d in drafts]
        dev = self.target.device
        trees = row_trees(torch.tensor(parent, dtype=torch.long, device=dev), self.depth, N, torch.tensor(real))
        return Proposal(torch.tensor(tokens, dtype=torch.long, device=dev).view(B, N), None, trees)


class SuffixChain(SuffixProposer):
    """Suffix decoding with chains for ``target``: each row's most frequent continuation (at most k tokens,
    padded with S[-1]: "padded", a step verifies only the real drafts; a greedy step is a decode step when no
    row has any), verified with ``ChainVerifier``; see ``SuffixProposer`` for the arguments."""

    abilities = SuffixProposer.abilities | {"padded"}

    def __init__(self, target: DecoderModel, cache: SuffixCache | None = None, *, alpha: float = 1.0,
                 offset: float = 0.0, min_prob: float = 0.1, cache_prompts: bool = False):
        super().__init__(target, cache, max_nodes=target.n_positions, alpha=alpha, offset=offset,
                         min_prob=min_prob, cache_prompts=cache_prompts)

    def propose(self, tail, lengths, k, params, rng) -> Proposal:
        return Proposal(self.matches(tail, lengths, k)[0], num_drafts=self.drafted.clone())

    def step_drafts(self, tail: torch.Tensor, lengths: torch.Tensor, k: int) -> list[Draft]:
        """Each row's chain: the most frequent continuation, at most k tokens."""
        return self.drafts(tail, lengths, k, k, tree=False)

    def matches(self, tail: torch.Tensor, lengths: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's k drafts [B, k] (padded with S[-1]) and the match length behind them [B] (0: none),
        as ``PromptLookup.matches``: what a per-row combination with a model draft chooses by."""
        drafts = self.step_drafts(tail, lengths, k)
        last = tail[:, 1].tolist()
        tokens = [d.tokens + [last[r]] * (k - len(d.tokens)) for r, d in enumerate(drafts)]
        return torch.tensor(tokens, dtype=torch.long).view(self.batch_size, k), self.matched.clone()
