"""Generation requests: validation of everything a request asks for (before any state changes),
and the output format.

Output format follows ``transformers``: the given ``input_ids`` (with their padding) followed by
the new tokens; rows that stop early are padded with ``pad_token_id``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .parallel import broadcast
from .sampling import row_seed


def resolve_budget(model, prompts: list[torch.Tensor], max_new_tokens: int | None,
                   sequence_length: int | None) -> torch.Tensor:
    """New-token budget per row [b]. ``sequence_length`` bounds prompt + new tokens per row (as in
    transformers-neuronx); ``max_new_tokens`` bounds new tokens; at least one must be given."""
    if max_new_tokens is None and sequence_length is None:
        raise ValueError("give max_new_tokens or sequence_length")
    lens = torch.tensor([len(p) for p in prompts])
    budget = torch.full_like(lens, 2**62)
    if max_new_tokens is not None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        budget = budget.clamp(max=max_new_tokens)
    if sequence_length is not None:
        if sequence_length > model.n_positions:
            raise ValueError(f"sequence_length={sequence_length} exceeds n_positions={model.n_positions}")
        budget = torch.minimum(budget, sequence_length - lens)
    need = lens + budget
    if bool((budget < 1).any()) or bool((need > model.n_positions).any()):
        i = int(torch.argmax((need > model.n_positions).long() + (budget < 1).long()))
        raise ValueError(f"prompt {i} has {int(lens[i])} tokens; with the requested new tokens it needs "
                         f"{int(lens[i] + max(int(budget[i]), 1))} positions, but n_positions={model.n_positions}"
                         + (f" and sequence_length={sequence_length}" if sequence_length else ""))
    return budget


def eos_ids(model, eos_token_id) -> torch.Tensor:
    """EOS ids as a 1-D tensor (default: the checkpoint's), empty to disable."""
    if eos_token_id is None:
        return torch.tensor(model.config.eos_token_ids, dtype=torch.long)
    return torch.as_tensor(eos_token_id, dtype=torch.long).flatten()


def stop_requested(stopping_criteria: Sequence[Callable] | None, sequences: torch.Tensor) -> torch.Tensor:
    """Evaluate HF-style stopping criteria (``criterion(input_ids, scores) -> bool | bool [b]``)."""
    done = torch.zeros(sequences.shape[0], dtype=torch.bool)
    for criterion in stopping_criteria or ():
        done |= torch.as_tensor(criterion(sequences, None)).cpu().bool().expand_as(done)
    return done


def format_output(input_ids, attention_mask, prompts: list[torch.Tensor], new_tokens: list[list[int]],
                  pad_token_id: int) -> torch.Tensor:
    """[b, L + max_new]: the caller's input_ids (or right-padded prompts) + new tokens, padded."""
    width = max(len(t) for t in new_tokens)
    new = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    for i, t in enumerate(new_tokens):
        new[i, : len(t)] = torch.tensor(t, dtype=torch.long)
    if isinstance(input_ids, torch.Tensor):
        base = input_ids.long().cpu().reshape(len(prompts), -1)
    else:
        base = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True, padding_value=pad_token_id)
    return torch.cat([base, new], dim=1)


@dataclass
class Request:
    """A validated generation request of b rows: prompts (padding stripped), per-row new-token budget
    [b], sampling params [batch_size, 4] (rows >= b unused), EOS ids, pad id and one seed per row."""

    prompts: list[torch.Tensor]
    budget: torch.Tensor
    params: torch.Tensor
    eos: torch.Tensor
    pad_token_id: int
    seeds: list[int]


def row_seeds(model, n: int, seed) -> list[int]:
    """One seed per row: from ``seed`` (an int: independent streams per row; a sequence: one per
    row), else drawn from torch's global generator (so ``torch.manual_seed`` reproduces a run)."""
    if seed is None:
        drawn = torch.randint(2**62, (n,), device=model.device)
        if model.tp.size > 1:   # every rank must draw the same sampling noise
            drawn = broadcast(drawn, model.tp)
        return [int(s) for s in drawn.cpu()]
    if isinstance(seed, (list, tuple, torch.Tensor)):
        seeds = [int(s) for s in seed]
        if len(seeds) != n:
            raise ValueError(f"seed has {len(seeds)} values; give one int or one per prompt ({n})")
        return seeds
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, a list of ints (one per prompt) or None, got {seed!r}")
    return [row_seed(seed, i) for i in range(n)]


def prepare_request(model, input_ids, attention_mask=None, *, max_new_tokens=None, sequence_length=None,
                    do_sample=None, temperature=None, top_k=None, top_p=None, repetition_penalty=None,
                    eos_token_id=None, pad_token_id=None, seed=None) -> Request:
    """Validate everything a request asks for before any state changes (errors leave the model intact)."""
    prompts = model.prepare_prompts(input_ids, attention_mask)
    budget = resolve_budget(model, prompts, max_new_tokens, sequence_length)
    params = model.sampling_params(top_k, top_p, temperature, do_sample, repetition_penalty)
    eos = eos_ids(model, eos_token_id)
    if pad_token_id is None:
        pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else \
            (int(eos[0]) if eos.numel() else 0)
    return Request(prompts, budget, params, eos, pad_token_id, row_seeds(model, len(prompts), seed))
