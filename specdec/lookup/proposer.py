"""``PromptLookup``: draft tokens copied from earlier in the row's own sequence (no draft model).

Per row, S = prompt + emitted tokens. For n = ``max_ngram`` down to ``min_ngram``: find the latest
earlier occurrence of S's last n tokens in S; the k tokens that followed it are the proposal (HF's
``prompt_lookup_num_tokens``, vLLM's ``ngram`` speculator). When fewer than k tokens follow it (the
match is near the end, as in a repeating stretch), the lookup continues from S + those tokens. A row
whose lookup finds no (further) match fills the rest with S[-1]: any token is safe, the verifier
decides. Proposals
are deterministic, so acceptance uses the one-hot rule (accept x with probability p(x), resample from
p without x on rejection): lossless. It pays where the output repeats its input: summaries, RAG
answers, code edits.

The sequences live on the host: ``start`` records each row's prompt and first token, ``accepted`` the
tokens each step emitted.
"""
from __future__ import annotations

import numpy as np
import torch

from ..core.decoder import DecoderModel
from ..speculation.proposer import BaseProposer, Proposal


class PromptLookup(BaseProposer):
    """Prompt-lookup drafting for ``target`` (a ``specdec.speculation.proposer.Proposer``): a chain proposer
    (no network, nothing to check, unfused) whose rows without a (long enough) match are padded ("padded":
    a step verifies only the drafts it found; a greedy step is a decode step when no row found any).
    After each ``matches`` / ``propose``: ``drafted`` [B] long, each row's real drafts."""

    abilities = frozenset({"padded"})

    def __init__(self, target: DecoderModel, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.target, self.max_ngram, self.min_ngram = target, max_ngram, min_ngram
        self.vocab_size, self.batch_size = target.vocab_size, target.batch_size
        self.seqs: list[list[int]] = [[] for _ in range(target.batch_size)]
        self.drafted = torch.zeros(target.batch_size, dtype=torch.long)

    def start(self, rows, prompts, params, rng, target_out) -> None:
        first = target_out.tokens[:, -1].tolist()
        for i, (r, p) in enumerate(zip(range(len(prompts)) if rows is None else rows, prompts)):
            self.seqs[r] = p.tolist() + [first[i]]

    def max_draft_tokens(self, length: int) -> int:
        return self.target.n_positions

    def propose(self, tail, lengths, k, params, rng) -> Proposal:
        return Proposal(self.matches(tail, lengths, k)[0], num_drafts=self.drafted.clone())

    def matches(self, tail: torch.Tensor, lengths: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's k drafts [B, k] (padded with S[-1]) and the length of the n-gram they continue [B]
        (0: no match); sets ``drafted``."""
        seqs = [self.seqs[r][:int(n)] if len(self.seqs[r]) >= int(n) else [int(tail[r, 1])]
                for r, n in enumerate(lengths.tolist())]
        found = [self.continuation(seq, k) for seq in seqs]
        self.drafted = torch.tensor([len(drafts) for drafts, _ in found], dtype=torch.long)
        return (torch.tensor([drafts + [seq[-1]] * (k - len(drafts)) for (drafts, _), seq in zip(found, seqs)],
                             dtype=torch.long),
                torch.tensor([n for _, n in found], dtype=torch.long))

    def lookup(self, seq: list[int], k: int) -> list[int]:
        """k tokens continuing ``seq`` (``match``'s drafts)."""
        return self.match(seq, k)[0]

    def match(self, seq: list[int], k: int) -> tuple[list[int], int]:
        """``continuation``'s drafts padded to k with S[-1], and its n."""
        drafts, first = self.continuation(seq, k)
        return drafts + [seq[-1]] * (k - len(drafts)), first

    def continuation(self, seq: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens continuing ``seq`` and the length n of the suffix n-gram the first of them continues
        (0: no match, no tokens): the tokens after the latest earlier occurrence of its longest matching
        suffix n-gram; when fewer than k follow it (a match near the end, as in a repeating stretch) the
        lookup continues from ``seq`` + those tokens, until no match is found."""
        out: list[int] = []
        first = 0
        while len(out) < k:
            follow, n = self._follow(np.asarray(seq + out, dtype=np.int64), k - len(out))
            if not follow:
                break
            first = first or n
            out += follow
        return out, first

    def _follow(self, s: np.ndarray, k: int) -> tuple[list[int], int]:
        """Up to k tokens after the latest earlier occurrence of ``s``'s longest matching suffix n-gram,
        and that n ([] and 0 without a match)."""
        for n in range(min(self.max_ngram, len(s) - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(s[:-1], n)   # every n-gram but the suffix
            hits = np.flatnonzero((windows == s[-n:]).all(axis=1))
            if hits.size:
                return s[hits[-1] + n:hits[-1] + n + k].tolist(), n
        return [], 0

    def accepted(self, lengths, verified) -> None:
        n = verified.num_accepted.tolist()
        emitted = verified.emitted.tolist()
        for r, length in enumerate(lengths.tolist()):
            if len(self.seqs[r]) == length:   # an active row: its sequence grows by n + 1 tokens
                self.seqs[r] += emitted[r][:n[r] + 1]
