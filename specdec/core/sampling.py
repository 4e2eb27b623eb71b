"""On-device sampling: repetition penalty → temperature → top-k → top-p warping and inverse-CDF sampling.

Per-row dynamic parameters come as ``params [B, 4] = (top_k, top_p, temperature, repetition_penalty)``
(NxD Inference's layout, plus the penalty). ``top_k <= 0`` disables top-k; ``temperature == 0`` makes
that row greedy; ``repetition_penalty == 1`` disables the penalty (``penalised``: Hugging Face's
``RepetitionPenaltyLogitsProcessor`` on the raw logits, before warping and before greedy argmax; the
graphs apply it, see ``specdec.core.graphs``). Noise is a uniform tensor ``u [B, m]`` drawn on the
device from a seeded ``torch.Generator`` outside the graph, so graphs stay pure functions and the same
seed reproduces the same tokens.

The warped distribution ``p`` is exactly the one the sampler draws from; speculation's acceptance
rule uses the same ``p``, which keeps it lossless.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

TOP_K, TOP_P, TEMPERATURE, REPETITION_PENALTY = 0, 1, 2, 3
"""Columns of the per-row parameter tensor ``params [B, 4]``."""


@dataclass(frozen=True)
class SamplingConfig:
    """Defaults for on-device sampling (NxD Inference's ``OnDeviceSamplingConfig`` names).

    do_sample: False → greedy graphs (argmax only); True → sampling graphs.
    top_k: keep the k most likely tokens (0 = off). top_p: nucleus mass in (0, 1].
    temperature: > 0 (0 = greedy for that row).
    global_topk: prefilter to this many candidates before warping (None = full vocabulary, exact
      with respect to plain temperature/top-p sampling; a number trades exactness of the far tail
      for speed, as NxD's ``global_topk``).
    """

    do_sample: bool = False
    top_k: int = 0
    top_p: float = 1.0
    temperature: float = 1.0
    global_topk: int | None = None

    def __post_init__(self):
        validate_sampling(self.top_k, self.top_p, self.temperature)
        if self.global_topk is not None and self.global_topk < 1:
            raise ValueError(f"global_topk must be None or >= 1, got {self.global_topk}")


def validate_sampling(top_k, top_p, temperature, repetition_penalty=1.0) -> None:
    """Raise a ValueError naming the bad value (scalars or per-row sequences/tensors)."""
    for name, value, ok, allowed in (
        ("top_k", top_k, lambda t: t >= 0, ">= 0 (0 disables top-k)"),
        ("top_p", top_p, lambda t: (t > 0) & (t <= 1), "in (0, 1]"),
        ("temperature", temperature, lambda t: t >= 0, ">= 0 (0 means greedy)"),
        ("repetition_penalty", repetition_penalty, lambda t: t > 0,
         "a finite number > 0 (1 disables it; > 1 discourages repeated tokens)"),
    ):
        t = torch.as_tensor(value, dtype=torch.float64)
        if not bool(torch.isfinite(t).all()) or not bool(ok(t).all()):
            raise ValueError(f"{name}={value!r} is invalid: must be {allowed}")
        if name == "top_k" and not bool((t == t.round()).all()):
            raise ValueError(f"top_k={value!r} is invalid: must be an integer >= 0")


def sampling_params(batch_size: int, top_k, top_p, temperature, repetition_penalty=1.0) -> torch.Tensor:
    """Validated per-row parameter tensor [batch_size, 4] (float32); scalars broadcast to all rows."""
    validate_sampling(top_k, top_p, temperature, repetition_penalty)
    cols = []
    for name, value in (("top_k", top_k), ("top_p", top_p), ("temperature", temperature),
                        ("repetition_penalty", repetition_penalty)):
        t = torch.as_tensor(value, dtype=torch.float32).flatten()
        if t.numel() == 1:
            t = t.expand(batch_size)
        elif t.numel() != batch_size:
            raise ValueError(f"{name} has {t.numel()} values; give one value or one per row ({batch_size})")
        cols.append(t)
    return torch.stack(cols, dim=1).contiguous()


def warp(logits: torch.Tensor, params: torch.Tensor, global_topk: int | None):
    """Warped distribution over sorted candidates.

    logits [B, m, V] f32, params [B, 4] → (probs [B, m, K], token_ids [B, m, K]) with candidates
    sorted by descending logit, K = V or ``global_topk``; each row of probs sums to 1.
    """
    if global_topk is None or global_topk >= logits.shape[-1]:
        values, ids = torch.sort(logits, dim=-1, descending=True)
    else:
        values, ids = torch.topk(logits, global_topk, dim=-1)
    top_k, top_p, temperature = (params[:, i].view(-1, 1, 1) for i in range(3))
    greedy = temperature <= 0
    values = values / torch.where(greedy, torch.ones_like(temperature), temperature)
    rank = torch.arange(values.shape[-1], device=values.device)
    values = values.masked_fill(~((top_k <= 0) | (rank < top_k)), float("-inf"))
    probs = torch.softmax(values, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    probs = torch.where(before < top_p, probs, torch.zeros_like(probs))
    probs = torch.where(greedy, (rank == 0).to(probs.dtype), probs)
    return probs / probs.sum(-1, keepdim=True), ids


def full_probs(probs: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Scatter sorted-candidate probabilities back to the vocabulary: [B, m, V]."""
    out = torch.zeros(*probs.shape[:-1], vocab_size, dtype=probs.dtype, device=probs.device)
    return out.scatter(-1, ids, probs)


def needs_filter(params: torch.Tensor, global_topk: int | None) -> bool:
    """Whether sampling with ``params`` [B, 4] needs the sorted top-k / top-p warping (``warp``):
    some row has top_k > 0 or top_p < 1, or a ``global_topk`` prefilter is configured. Otherwise
    ``warp_temperature`` gives the same distribution without sorting the vocabulary."""
    return global_topk is not None or bool(((params[:, TOP_K] > 0) | (params[:, TOP_P] < 1)).any())


def greedy_rows(params: torch.Tensor) -> torch.Tensor:
    """[B] bool: the rows of ``params`` [B, 4] that decode greedily (temperature 0)."""
    return params[:, TEMPERATURE] <= 0


def any_sampled(params: torch.Tensor) -> bool:
    """Whether some row of ``params`` [B, 4] samples (needs a sampling graph); one host read."""
    return bool((params[:, TEMPERATURE] > 0).any())


def any_penalised(params: torch.Tensor) -> bool:
    """Whether some row of ``params`` [B, 4] has a repetition penalty (!= 1); one host read."""
    return bool((params[:, REPETITION_PENALTY] != 1).any())


def penalised(logits: torch.Tensor, params: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Hugging Face's repetition penalty: logits [b, m, V] f32, params [b, 4], seen [b, m, V] bool
    (the tokens already in the sequence each position continues) → logits [b, m, V] where every seen
    token's logit x becomes x / penalty if x > 0 else x * penalty (per row; penalty 1 changes nothing).
    Applied to the raw logits, before temperature / top-k / top-p warping and greedy argmax."""
    penalty = params[:, REPETITION_PENALTY].view(-1, 1, 1)
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def warp_temperature(logits: torch.Tensor, params: torch.Tensor, top: torch.Tensor | None = None) -> torch.Tensor:
    """Temperature-only warping in vocabulary order: logits [B, m, V] f32 → probs [B, m, V]
    (softmax(logits / T); one-hot argmax for greedy rows; ``top`` [B, m]: the argmax, where the caller has it).
    Equals ``warp`` (scattered back to the vocabulary) for rows with top_k = 0 and top_p = 1, without its sort."""
    temperature = params[:, TEMPERATURE].view(-1, 1, 1)
    greedy = temperature <= 0
    probs = torch.softmax(logits / torch.where(greedy, torch.ones_like(temperature), temperature), dim=-1)
    top = (logits.argmax(-1) if top is None else top).unsqueeze(-1)
    at_top = torch.where(greedy, 1.0, probs.gather(-1, top))       # a sampled row keeps its own value there
    return probs.masked_fill_(greedy, 0.0).scatter_(-1, top, at_top)


def sample(logits: torch.Tensor, params: torch.Tensor, uniform: torch.Tensor, global_topk: int | None,
           return_probs: bool = False, top_filter: bool = True):
    """Draw one token per position: logits [B, m, V], uniform [B, m] in [0, 1) → tokens [B, m].

    Greedy rows (temperature 0) return the argmax exactly. With ``return_probs`` also returns the
    warped distribution [B, m, V]. ``top_filter=False`` (only valid when ``needs_filter`` is false)
    samples by inverse CDF in vocabulary order from ``warp_temperature``: the same distribution,
    no sort.
    """
    top = logits.argmax(-1)
    if top_filter:
        probs, ids = warp(logits, params, global_topk)
        probs = full_probs(probs, ids, logits.shape[-1])
    else:
        probs = warp_temperature(logits, params, top)
    b, m, V = probs.shape
    tokens = inverse_cdf(probs.reshape(b * m, V), uniform.reshape(b * m)).view(b, m)
    tokens = torch.where(greedy_rows(params).unsqueeze(1), top, tokens)
    return (tokens, probs) if return_probs else tokens


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw from unnormalised ``weights [N, V]`` (>= 0, positive sum) with ``u [N]`` in [0, 1) → [N] long.

    y = #{i : cdf_i <= u * total}, in vocabulary order: zero-weight tokens are never chosen (their cdf
    equals the previous one), also for u == 0; clamped to the first index where the cdf reaches the
    total, so rounding of u * total up to total cannot select a zero-weight tail token. Every
    categorical draw of the package (sampling and the acceptance rules) goes through it, so one
    uniform gives one token whichever warping produced the weights.
    """
    cdf = torch.cumsum(weights, dim=-1)
    total = cdf[:, -1:]
    choice = (cdf <= u.view(-1, 1) * total).sum(-1)
    last = (cdf < total).sum(-1)
    return torch.minimum(choice, last)


class RowGenerators:
    """One seeded ``torch.Generator`` per batch row (slot), so a row's random draws depend only on
    its own seed and its own history, never on its neighbours.

    ``seed(row, seed)`` (re)starts a row's stream; ``release(row)`` frees it; ``uniform(m)`` →
    [B, m] in [0, 1) with row r drawn from row r's generator (zeros for rows without one).
    Draws happen outside the graphs (host loop over rows) and enter them as inputs. On an XLA device,
    which has no ``torch.Generator``, the streams are the CPU's and the draws are copied to the device.
    """

    def __init__(self, batch_size: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.draw_device = torch.device("cpu") if self.device.type == "xla" else self.device
        self.generators: list[torch.Generator | None] = [None] * batch_size

    @property
    def splits_draws(self) -> bool:
        """Whether n draws then m draws are the n + m draws of one call, so a draw can be split without
        changing a stream (CPU generators; CUDA's Philox streams advance per call)."""
        return self.draw_device.type == "cpu"

    def seed(self, row: int, seed: int) -> None:
        self.generators[row] = torch.Generator(self.draw_device).manual_seed(seed)

    def release(self, row: int) -> None:
        self.generators[row] = None

    def uniform(self, m: int, rows: list[int] | None = None) -> torch.Tensor:
        """[len(rows), m] (default every row): each listed row draws m numbers from its own stream;
        rows not listed draw nothing."""
        zeros = torch.zeros(m, device=self.draw_device)
        gens = self.generators if rows is None else [self.generators[r] for r in rows]
        draws = torch.stack([zeros if g is None else torch.rand(m, generator=g, device=self.draw_device) for g in gens])
        return draws.to(self.device)


def row_seed(seed: int, row: int) -> int:
    """The seed of row ``row`` of a request seeded with ``seed`` (independent streams per row)."""
    return int(np.random.SeedSequence([seed, row]).generate_state(1, np.uint64)[0])
