"""Prompt input: the accepted forms of ``input_ids`` checked and turned into one 1-D LongTensor per row."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

_ROW_TYPES = (list, tuple, torch.Tensor, np.ndarray)
_TEXT_HINT = "tokenize it first (model.tokenizer, or specdec.core.chat.chat_ids for a chat prompt)"


def _ids_tensor(x, what: str, integers: bool = True) -> torch.Tensor:
    """``x`` as a tensor of token ids (``integers``; else of numbers: a mask), or ValueError naming ``what`` and
    what ``x`` is (text, a float or bool dtype where ids are due, anything torch cannot read as numbers)."""
    if isinstance(x, (str, bytes)) or (isinstance(x, (list, tuple)) and x and isinstance(x[0], (str, bytes))):
        raise ValueError(f"{what} must be token ids, got text: {_TEXT_HINT}")
    try:
        t = torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError):
        kind = "token ids (a LongTensor, or lists of ints)" if integers else "a tensor or lists of 0 / 1"
        raise ValueError(f"{what} must be {kind}, got {type(x).__name__}"
                         + (f" of {type(x[0]).__name__}" if isinstance(x, (list, tuple)) and x else "")) from None
    if integers and t.numel() and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise ValueError(f"{what} must be integer token ids, got dtype {t.dtype}")
    return t


def prompt_rows(input_ids, attention_mask, batch_size: int, vocab_size: int, longest: int,
                n_positions: int) -> list[torch.Tensor]:
    """Validate prompts and strip padding: a [b, L] tensor or array (+ optional attention mask [b, L], left
    or right padding), a 1-D one, a list of token lists / 1-D tensors, or a tokenizer's output (a mapping with
    ``input_ids`` and, unless ``attention_mask`` is given, its ``attention_mask``) → b 1-D LongTensors (host),
    each non-empty, of ids in [0, vocab_size) and at most ``longest`` (the largest context bucket) long;
    b <= batch_size. ValueError otherwise (text, floats, other objects; ``n_positions`` is named in the length
    error)."""
    if isinstance(input_ids, Mapping):      # e.g. tokenizer(text, return_tensors="pt"): a BatchEncoding
        if "input_ids" not in input_ids:
            raise ValueError(f"input_ids is a mapping without an 'input_ids' entry (keys: {sorted(input_ids)})")
        if attention_mask is None:
            attention_mask = input_ids.get("attention_mask")
        input_ids = input_ids["input_ids"]
    nested = isinstance(input_ids, (list, tuple)) and input_ids and isinstance(input_ids[0], _ROW_TYPES)
    if nested and attention_mask is not None and len({len(r) for r in input_ids}) > 1:
        raise ValueError("attention_mask is only accepted with input_ids of one length per row ([batch, length])")
    if nested and attention_mask is None:
        rows = []
        for i, r in enumerate(input_ids):
            r = _ids_tensor(r, f"prompt {i}")
            if r.dim() > 1:
                raise ValueError(f"prompt {i} must be a flat sequence of integer token ids, got shape {tuple(r.shape)}")
            rows.append(r.long().flatten())
    else:
        ids = _ids_tensor(input_ids, "input_ids")
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(ids.shape)}")
        ids = ids.long().cpu()
        if attention_mask is None:
            rows = list(ids)
        else:
            mask = _ids_tensor(attention_mask, "attention_mask", integers=False).cpu()
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
