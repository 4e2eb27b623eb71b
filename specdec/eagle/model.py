"""The EAGLE-1 draft network as plain math over tensors, on the runtime's static KV cache.

    x      = fc(concat(embed(token_{i+1}), feature_i))          [B, n, H]   (fc: 2H → H, bias optional)
    x      = DecoderLayer(x)   one Llama layer; its input RMSNorm only with ``input_norm=True``
                               (NxD Inference's ``enable_eagle_draft_input_norm``), no final norm
    logits = lm_head(x)        the target's LM head (or the rows of a reduced draft vocabulary)

Draft position i pairs the target's feature at i (its final-norm hidden state, which predicts
token i+1) with the token at i+1; its output x_i is the draft's guess of the target feature at
i+1, so ``lm_head(x_i)`` predicts token i+2. The forward has the runtime's graph signature plus
``features`` (see ``specdec.core.model``):

    forward(input_ids [B, n], position_ids [B, n], cache_lengths [B], token_mask [B, n, n],
            logit_index [B, m], features [B, n, H], kv_len) -> (logits [B, m, V] f32, x [B, n, H])

Parameter names are the EAGLE-1 checkpoint keys (``fc.*``, ``layers.0.*``, ``embed_tokens.weight``,
``lm_head.weight``); ``output_token_ids`` [N] names the tokens of a reduced LM head.
"""
from __future__ import annotations

import torch
from torch import nn

from ..core.config import ModelConfig
from ..core.model import (DecoderLayer, full_vocab_logits, new_token_slots, pick_positions, rope_inv_freq,
                          rope_tables)
from ..core.parallel import TPGroup
from ..core.tp_layout import head_layout


class EagleLM(nn.Module):
    def __init__(self, config: ModelConfig, batch_size: int, n_positions: int, dtype: torch.dtype,
                 input_norm: bool = False, fc_bias: bool = True, kv_cache_dtype: str | None = None):
        super().__init__()
        if config.num_layers != 1:
            raise ValueError(f"an EAGLE-1 draft has one decoder layer; its config says num_hidden_layers="
                             f"{config.num_layers}")
        h = config.hidden_size
        self.config, self.feature_size, self.input_norm, self.tp = config, h, input_norm, TPGroup()
        self.feature_dtype = dtype
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        layout = head_layout(config.num_heads, config.num_kv_heads, 1)
        self.layers = nn.ModuleList([DecoderLayer(config, batch_size, n_positions, dtype, layout, TPGroup(),
                                                  kv_cache_dtype)])
        if not input_norm:
            self.layers[0].input_layernorm = nn.Identity()
        self.lm_head = nn.Linear(h, config.output_vocab_size or config.vocab_size, bias=False)
        if config.output_vocab_size:
            self.register_buffer("output_token_ids", torch.empty(config.output_vocab_size, dtype=torch.long))
        inv_freq, self.rope_scaling = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def init_buffers(self) -> None:
        """Restore what ``to_empty``/dtype casts lose: f32 RoPE frequencies, zero caches (and scales)."""
        self.inv_freq = rope_inv_freq(self.config)[0].to(self.fc.weight.device)
        self.layers[0].self_attn.init_cache()

    def forward(self, input_ids, position_ids, cache_lengths, token_mask, logit_index, features, kv_len: int,
                seq_ids=None):
        x = self.fc(torch.cat((self.embed_tokens(input_ids), features.to(self.fc.weight.dtype)), -1))
        cos, sin = rope_tables(position_ids, self.inv_freq, self.rope_scaling, x.dtype)
        slots, mask = new_token_slots(cache_lengths, token_mask, kv_len)
        x = self.layers[0](x, cos, sin, slots, mask, kv_len, seq_ids)
        logits = self.lm_head(pick_positions(x, logit_index))
        return full_vocab_logits(logits, self.config, getattr(self, "output_token_ids", None)), x
