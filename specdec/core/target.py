"""What the request loop (``engine``) needs of a model: the output of one graph call (``StepOutput``) and the
``Target`` protocol, which ``DecoderModel`` implements. Declared here, below both, so that the engine
depends on the protocol and not on the decoder's module (which runs the engine in ``generate``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .prefix_store import PrefixStore
from .sampling import RowGenerators


@dataclass
class StepOutput:
    """tokens [B, m] sampled on device, logits [B, m, V] (f32: raw, or with the repetition penalty
    applied when the graph has it — the logits the tokens are sampled from), hidden [B, n, H]
    (final-norm hidden states of every new token), probs [B, m, V] warped distribution when requested,
    aux_hidden [B, n, A·H]: the hidden states entering the model's A ``feature_layers``, in layer order
    (None without feature layers). A ``top_k`` step's tokens [B, m, K] are the K most likely tokens
    (best first) and its logits [B, m, K] their log-softmax (f32)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    hidden: torch.Tensor
    probs: torch.Tensor | None = None
    aux_hidden: torch.Tensor | None = None


class Target(Protocol):
    """The model a request loop drives (``DecoderModel``; see its methods for the contracts): ``batch_size``
    rows on ``device``, their lengths, the tokens each row has seen (repetition penalty), per-row
    sampling parameters, context encoding and n-token steps, and (``prefix_cache``) which tokens' KV each row
    keeps for the next prompt."""

    batch_size: int
    device: torch.device
    prefix_cache: bool
    prompt_tokens_kept: int
    prefix_store: PrefixStore | None

    def set_lengths(self, lengths: torch.Tensor) -> None: ...

    def shared_prefix(self, row: int, prompt: list[int]) -> int: ...

    def keep_prefix(self, row: int, tokens: list[int]) -> None: ...

    def cached_length(self, row: int) -> int: ...

    def track_presence(self) -> None: ...

    def reset_presence(self, row: int, tokens: torch.Tensor | list[int]) -> None: ...

    def mark_presence(self, rows: torch.Tensor | list[int], tokens: torch.Tensor | list[int]) -> None: ...

    def sampling_params(self, top_k=None, top_p=None, temperature=None, do_sample=None,
                        repetition_penalty=None) -> torch.Tensor: ...

    def prefill(self, prompts: list[torch.Tensor], params: torch.Tensor,
                rng: RowGenerators | torch.Generator | None = None, features: torch.Tensor | None = None,
                rows: list[int] | None = None) -> StepOutput: ...

    def step(self, tokens: torch.Tensor, params: torch.Tensor, rng: RowGenerators | torch.Generator | None = None,
             token_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
             advance: bool = True, return_probs: bool = False, rows: torch.Tensor | None = None,
             logit_index: torch.Tensor | None = None, features: torch.Tensor | None = None,
             top_k: int = 0) -> StepOutput: ...
