"""The EAGLE draft networks as plain math over tensors, on the runtime's static KV cache.

EAGLE-1 (``EagleLM``):

    x      = fc(concat(embed(token_{i+1}), feature_i))          [B, n, H]   (fc: 2H → H, bias optional)
    x      = DecoderLayer(x)   one Llama layer; its input RMSNorm only with ``input_norm=True``
                               (NxD Inference's ``enable_eagle_draft_input_norm``), no final norm
    logits = lm_head(x)        the target's LM head (or the rows of a reduced draft vocabulary)

EAGLE-3 (``Eagle3LM``; vLLM's ``llama_eagle3``, ``norm_before_residual`` false):

    a      = attn(concat(input_layernorm(embed(token_{i+1})), hidden_norm(feature_i)))   q/k/v read 2H
    x      = feature_i + a;   x = x + mlp(post_attention_layernorm(x))                  [B, n, H]
    logits = lm_head(norm(x))  the draft's own head over its reduced vocabulary (``output_token_ids``)

EAGLE-1's feature_i is the target's final-norm hidden state at i; EAGLE-3's is ``fc`` [H, A·H] of
the target's A auxiliary hidden states at i (low / middle / high layers, ``project``) — applied
outside the graph when the drafting strategy stores true features, so both networks take H-wide
features. On later drafting steps both read their own output x (EAGLE-3: before the final norm).

Draft position i pairs the feature at i (which predicts token i+1) with the token at i+1; its output
x_i is the draft's guess of the feature at i+1, so the logits of x_i predict token i+2. The forward
has the runtime's graph signature plus ``features`` (see ``specdec.core.model``):

    forward(input_ids [B, n], position_ids [B, n], cache_lengths [B], token_mask [B, n, n],
            logit_index [B, m], features [B, n, H], kv_len) -> (logits [B, m, V] f32, x [B, n, H])

Parameter names are the checkpoint keys (``fc.*``, ``layers.0.*``, ``embed_tokens.weight``,
``lm_head.weight``, EAGLE-3: ``norm.weight``); ``output_token_ids`` [N] names the tokens of a reduced
LM head.
"""
from __future__ import annotations

import torch
from torch import nn

from ..core.config import ModelConfig
from ..core.model import (
    MLP,
    Attention,
    DecoderLayer,
    RMSNorm,
    full_vocab_logits,
    new_token_slots,
    pick_positions,
    rope_inv_freq,
    rope_tables,
)
from ..core.parallel import TPGroup
from ..core.tp_layout import head_layout


class EagleNetwork(nn.Module):
    """What both EAGLE networks share: the embedding, the (reduced) LM head, RoPE and the forward
    around ``block`` (the draft layer) and ``head_input`` (what the LM head reads)."""

    aux_layers: tuple[int, ...] = ()     # target layers whose hidden states ``project`` reads (EAGLE-3)

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        if config.num_layers != 1:
            raise ValueError(f"an EAGLE draft has one decoder layer; its config says num_hidden_layers="
                             f"{config.num_layers}")
        h = config.hidden_size
        self.config, self.feature_size, self.feature_dtype, self.tp = config, h, dtype, TPGroup()
        self.target_hidden_size = h
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.lm_head = nn.Linear(h, config.output_vocab_size or config.vocab_size, bias=False)
        if config.output_vocab_size:
            self.register_buffer("output_token_ids", torch.empty(config.output_vocab_size, dtype=torch.long))
        inv_freq, self.rope_scaling = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def init_buffers(self) -> None:
        """Restore what ``to_empty``/dtype casts lose: f32 RoPE frequencies, zero caches (and scales)."""
        self.inv_freq = rope_inv_freq(self.config)[0].to(self.lm_head.weight.device)
        self.layers[0].self_attn.init_cache()

    def project(self, hidden: torch.Tensor, aux_hidden: torch.Tensor | None) -> torch.Tensor:
        """The draft's true feature [B, n, H] from the target's final-norm hidden states [B, n, H] and aux
        hidden states [B, n, A·H] (None without feature layers). EAGLE-1: the final-norm hidden state."""
        return hidden

    def block(self, embedded, features, cos, sin, slots, mask, kv_len: int, seq_ids):
        raise NotImplementedError

    def head_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the LM head reads from the layer's output x (EAGLE-1: x itself)."""
        return x

    def forward(self, input_ids, position_ids, cache_lengths, token_mask, logit_index, features, kv_len: int,
                seq_ids=None):
        embedded = self.embed_tokens(input_ids)
        cos, sin = rope_tables(position_ids, self.inv_freq, self.rope_scaling, embedded.dtype)
        slots, mask = new_token_slots(cache_lengths, token_mask, kv_len)
        x = self.block(embedded, features.to(embedded.dtype), cos, sin, slots, mask, kv_len, seq_ids)
        logits = self.lm_head(self.head_input(pick_positions(x, logit_index)))
        return full_vocab_logits(logits, self.config, getattr(self, "output_token_ids", None)), x


class EagleLM(EagleNetwork):
    """The EAGLE-1 network (module docstring)."""

    def __init__(self, config: ModelConfig, batch_size: int, n_positions: int, dtype: torch.dtype,
                 input_norm: bool = False, fc_bias: bool = True, kv_cache_dtype: str | None = None):
        super().__init__(config, dtype)
        h = config.hidden_size
        self.input_norm = input_norm
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        layout = head_layout(config.num_heads, config.num_kv_heads, 1)
        self.layers = nn.ModuleList([DecoderLayer(config, batch_size, n_positions, dtype, layout, TPGroup(),
                                                  kv_cache_dtype)])
        if not input_norm:
            self.layers[0].input_layernorm = nn.Identity()

    def block(self, embedded, features, cos, sin, slots, mask, kv_len: int, seq_ids):
        x = self.fc(torch.cat((embedded, features), -1))
        return self.layers[0](x, cos, sin, slots, mask, kv_len, seq_ids)


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over [input_layernorm(embedding) | hidden_norm(feature)] (2H),
    the residual stream starting at the feature (module docstring)."""

    def __init__(self, c: ModelConfig, batch_size: int, n_positions: int, dtype: torch.dtype,
                 kv_cache_dtype: str | None = None):
        super().__init__()
        h = c.hidden_size
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, c.rms_norm_eps)
        self.self_attn = Attention(c, batch_size, n_positions, dtype, head_layout(c.num_heads, c.num_kv_heads, 1),
                                   TPGroup(), kv_cache_dtype, in_features=2 * h)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.mlp = MLP(c, TPGroup())

    def forward(self, embedded, features, cos, sin, slots, mask, kv_len: int, seq_ids=None):
        """embedded, features [b, n, H] → the layer's output [b, n, H] (before the final norm)."""
        attn_in = torch.cat((self.input_layernorm(embedded), self.hidden_norm(features)), -1)
        x = features + self.self_attn(attn_in, cos, sin, slots, mask, kv_len, seq_ids)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3LM(EagleNetwork):
    """The EAGLE-3 network (module docstring); ``aux_layers``: the target layers (ascending) whose
    input hidden states ``fc`` [H, A·H_target] projects to the draft's feature."""

    def __init__(self, config: ModelConfig, batch_size: int, n_positions: int, dtype: torch.dtype,
                 aux_layers: tuple[int, ...], target_hidden_size: int, kv_cache_dtype: str | None = None):
        super().__init__(config, dtype)
        h = config.hidden_size
        self.aux_layers, self.target_hidden_size = tuple(aux_layers), target_hidden_size
        self.fc = nn.Linear(len(self.aux_layers) * target_hidden_size, h, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(config, batch_size, n_positions, dtype, kv_cache_dtype)])
        self.norm = RMSNorm(h, config.rms_norm_eps)

    def project(self, hidden: torch.Tensor, aux_hidden: torch.Tensor | None) -> torch.Tensor:
        """fc of the target's aux hidden states [B, n, A·H] → the draft's true feature [B, n, H]."""
        if aux_hidden is None or aux_hidden.shape[-1] != self.fc.in_features:
            raise ValueError(f"an EAGLE-3 draft reads the hidden states entering target layers {list(self.aux_layers)} "
                             f"({self.fc.in_features} values per token), got "
                             f"{None if aux_hidden is None else aux_hidden.shape[-1]}: set them with "
                             "target.use_feature_layers(...) (EagleModel.from_pretrained does)")
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def block(self, embedded, features, cos, sin, slots, mask, kv_len: int, seq_ids):
        return self.layers[0](embedded, features, cos, sin, slots, mask, kv_len, seq_ids)

    def head_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)
