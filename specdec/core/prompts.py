"""Prompt input: the accepted forms of ``input_ids`` checked and turned into one 1-D LongTensor per row."""
from __future__ import annotations

import torch


def prompt_rows(input_ids, attention_mask, batch_size: int, vocab_size: int, longest: int,
                n_positions: int) -> list[torch.Tensor]:
    """Validate prompts and strip padding: a [b, L] tensor (+ optional attention mask [b, L], left or
    right padding), a 1-D tensor, or a list of token lists → b 1-D LongTensors (host), each non-empty, of
    ids in [0, vocab_size) and at most ``longest`` (the largest context bucket) long; b <= batch_size.
    ValueError otherwise (``n_positions`` is named in the length error)."""
    if isinstance(input_ids, (list, tuple)) and input_ids and isinstance(input_ids[0], (list, tuple, torch.Tensor)):
        if attention_mask is not None:
            raise ValueError("attention_mask is only accepted with a [batch, length] tensor")
        rows = []
        for i, r in enumerate(input_ids):
            r = torch.as_tensor(r)
            if r.dim() > 1 or (r.is_floating_point() and r.numel()):
                raise ValueError(f"prompt {i} must be a flat sequence of integer token ids, "
                                 f"got dtype {r.dtype} and shape {tuple(r.shape)}")
            rows.append(r.long().flatten())
    else:
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(ids.shape)}")
        if ids.is_floating_point() and ids.numel():  # `[]` is an empty prompt, reported below
            raise ValueError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
        ids = ids.long().cpu()
        if attention_mask is None:
            rows = list(ids)
        else:
            mask = torch.as_tensor(attention_mask).cpu()
            if mask.shape != ids.shape:
                raise ValueError(f"attention_mask shape {tuple(mask.shape)} != input_ids shape {tuple(ids.shape)}")
            rows = [r[m.bool()] for r, m in zip(ids, mask)]
    if not rows:
        raise ValueError("input_ids is empty: give at least one prompt")
    if len(rows) > batch_size:
        raise ValueError(f"batch of {len(rows)} prompts exceeds the compiled batch_size={batch_size}")
    for i, r in enumerate(rows):
        if r.numel() == 0:
            raise ValueError(f"prompt {i} is empty: every row needs at least one token")
        if bool((r < 0).any()) or bool((r >= vocab_size).any()):
            bad = r[(r < 0) | (r >= vocab_size)][0].item()
            raise ValueError(f"prompt {i} has token id {bad} outside the vocabulary [0, {vocab_size})")
        if r.numel() > longest:
            raise ValueError(f"prompt {i} has {r.numel()} tokens; the largest context bucket is "
                             f"{longest} (n_positions={n_positions})")
    return rows
