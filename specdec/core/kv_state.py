"""``KVState``: the per-row bookkeeping of a decoder's KV cache (the cache tensors live in the module).

- ``lengths`` [batch_size] long, on the host: row b's sequence fills cache slots [0, lengths[b]); the
  authority for bucket choice. Rolling back = moving a length back (stale slots are masked, later
  overwritten); always updated in place, so the tensor object never changes.
- ``presence`` [batch_size, V] bool on the device, or None (not tracked, e.g. draft models): the tokens in
  each row's sequence (prompt + emitted), which the repetition penalty reads.
- slot copies (``copy_slots``): the compaction of accepted tree paths, one graph call on the device.
- ``cached`` (host): per row, the token ids whose KV fills its first slots (``cached[b][:j]`` at slots [0, j),
  each computed with the ids before it as context), what a prompt encoding may keep (prefix caching,
  ``DecoderModel.prefill``). A prompt's encoding sets it to the prompt; every graph call forgets a row's record
  from the first slot it writes (``forget_from``); the owner of a row extends it with what it knows the slots
  hold (``keep``: the request loop, a request's S[:-1] when it ends). So the record never claims a slot
  that something wrote since, whoever wrote it (models shared by several request loops included). Kept only
  with ``prefix_cache`` (else every record stays empty).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .prefix_store import shared_length


class KVState:
    """Lengths and presence of ``batch_size`` rows of up to ``n_positions`` tokens over a ``vocab_size``
    vocabulary; ``compaction(m)``: the decoder's KV-compaction graph moving m slots per row."""

    def __init__(self, batch_size: int, n_positions: int, vocab_size: int, device: torch.device,
                 compaction: Callable[[int], Callable], prefix_cache: bool = False):
        self.n_positions, self.vocab_size, self.device, self.compaction = n_positions, vocab_size, device, compaction
        self.prefix_cache = prefix_cache
        self.lengths = torch.zeros(batch_size, dtype=torch.long)
        self.presence: torch.Tensor | None = None
        self.cached: list[list[int]] = [[] for _ in range(batch_size)]

    def reset(self) -> None:
        """Every row empty."""
        self.lengths.zero_()
        self.cached = [[] for _ in self.cached]

    def shared_prefix(self, row: int, prompt: torch.Tensor | list[int]) -> int:
        """How many leading ids of ``prompt`` (1-D) row ``row``'s cache already holds the KV of (at most
        len(prompt) - 1: a prompt's last id is always fed, for the logits of the next token)."""
        cached = self.cached[row][:len(prompt) - 1]     # one copy (a server reads it while its engine steps)
        head = prompt[:len(cached)]
        return shared_length(cached, head if isinstance(head, list) else head.tolist())

    def keep(self, row: int, tokens: torch.Tensor | list[int]) -> None:
        """Row ``row``'s slots [0, len(tokens)) hold the KV of ``tokens`` (ids, 1-D; the caller's knowledge)."""
        if len(tokens) > self.n_positions:
            raise ValueError(f"{len(tokens)} tokens do not fit {self.n_positions} cache slots")
        if self.prefix_cache:
            self.cached[row] = torch.as_tensor(tokens).tolist()

    def forget_from(self, starts: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """A graph wrote ``rows`` (1-D; default all) from slot starts[i] on: their records stop there."""
        if not self.prefix_cache:
            return
        rows = range(len(self.cached)) if rows is None else rows.tolist()
        for row, start in zip(rows, starts.tolist()):
            del self.cached[row][max(start, 0):]

    def set_lengths(self, lengths: torch.Tensor) -> None:
        """Roll rows back (or forward over already-written slots): lengths [batch_size]."""
        lengths = torch.as_tensor(lengths, dtype=torch.long).cpu()
        if lengths.shape != self.lengths.shape or bool((lengths < 0).any()) or \
                bool((lengths > self.n_positions).any()):
            raise ValueError(f"lengths must be [{self.lengths.shape[0]}] in [0, {self.n_positions}], "
                             f"got {lengths.tolist()}")
        self.lengths.copy_(lengths)

    def track_presence(self) -> None:
        """Start tracking ``presence`` (every row empty; a no-op when already tracking)."""
        if self.presence is None:
            self.presence = torch.zeros(self.lengths.shape[0], self.vocab_size, dtype=torch.bool, device=self.device)

    def reset_presence(self, row: int, tokens: torch.Tensor | list[int]) -> None:
        """Row ``row``'s sequence restarts as ``tokens`` (ids, 1-D): one copy to the device."""
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[torch.as_tensor(tokens, dtype=torch.long)] = True
        self.presence[row] = mask.to(self.device)

    def mark_presence(self, rows: torch.Tensor | list[int], tokens: torch.Tensor | list[int]) -> None:
        """Token tokens[i] was appended to row rows[i]'s sequence (rows, tokens: 1-D, same length):
        one index_put on the device."""
        index = (torch.as_tensor(rows, dtype=torch.long).to(self.device),
                 torch.as_tensor(tokens, dtype=torch.long).to(self.device))
        self.presence.index_put_(index, torch.ones((), dtype=torch.bool, device=self.device))

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """In every layer, row b's cache slot src[b, i] (K, V and, quantized, their scales) is copied to
        slot dst[b, i] (src, dst [B, m]; all slots are read before any is written)."""
        with torch.no_grad():
            self.compaction(src.shape[1])(src.to(self.device).contiguous(), dst.to(self.device).contiguous())
        if self.prefix_cache:
            self.forget_from(dst.cpu().amin(1))
