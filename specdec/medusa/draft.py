"""``MedusaDraft``: Medusa heads + a token tree bound to a target — a tree proposer.

Use it like any draft: ``SpeculativeGenerator(MedusaDraft.from_pretrained(path, target, tree=...), target)``
(k = the tree's depth). Per row, S = prompt + emitted tokens; the heads' top-k candidates were computed
from the target's hidden state at the position that produced S[-1]:
  1. ``propose``: the N tree nodes' tokens, gathered from the candidates (``gather_tree_tokens``), with
     the tree's buffers per row;
  2. the ``TreeVerifier`` runs the target once over [S[-1], nodes] with the tree mask, accepts a path
     (greedy, lossless multi-draft rejection, or the lossy typical rule) and compacts its KV rows;
  3. ``accepted``: the next candidates are the heads applied to the hidden state of the last accepted
     node — from the same forward, no extra target pass.
When fewer than N slots are left before ``n_positions`` the step is a plain decode step.
The heads follow the target's weight-only quantization (``from_pretrained``): under "int8" / "int4" the
ResBlocks take the target's scheme and the vocabulary projections per-channel int8, as the target's LM
head (``MedusaHeads.quantize``); tied heads start from the head's computed weight (what a quantized
or GGUF head applies) and, under "int8" / "int4", share one int8 projection; "gguf" leaves them float.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..core.decoder import DecoderModel
from ..core.quant import computed_weight
from ..speculation.proposer import BaseProposer, Proposal, refuse_prefix_cache
from ..speculation.tree import TokenTree, tree_buffers
from ..speculation.verify import TREE_ACCEPTANCE, TreeVerifier
from .heads import MedusaHeads, load_heads, load_medusa_config
from .tree import gather_tree_tokens, load_tree


class MedusaDraft(BaseProposer):
    """Medusa heads and a tree for ``target`` (a ``DecoderModel`` at tp_degree 1).

    ``acceptance``: 'lossless' (greedy rows: the longest path matching the target argmax; sampled rows:
    recursive rejection over siblings, the target's distribution exactly) or 'typical' (Medusa's typical
    acceptance: NOT lossless, changes the output distribution of sampled rows; ``typical_epsilon`` /
    ``typical_delta`` are Medusa's posterior_threshold / posterior_alpha).
    A tree proposer with no draft network: the heads read the target's own verify outputs.
    """

    abilities = frozenset({"depth", "verifier", "verify_size", "check_target"})

    def __init__(self, heads: MedusaHeads, tree: TokenTree, target: DecoderModel, acceptance: str = "lossless",
                 typical_epsilon: float = 0.09, typical_delta: float = 0.3):
        check_medusa(heads, tree, target, acceptance)
        self.heads = self.module = heads.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
        self.tree, self.target = tree, target
        self.verifier = TreeVerifier(acceptance, typical_epsilon, typical_delta)
        self.buffers = tree_buffers(tree, target.device)
        self.row_buffers = self.buffers.per_row(target.batch_size)
        self.candidates = torch.zeros(target.batch_size, heads.num_heads, tree.top_k, dtype=torch.long,
                                      device=target.device)   # [B, num_heads, top_k] for the next step

    @classmethod
    def from_pretrained(cls, path: str | Path, target: DecoderModel, *, tree: str | Path | TokenTree | None = None,
                        acceptance: str = "lossless", **kwargs) -> MedusaDraft:
        """Load heads in the FasterDecoding/Medusa layout. ``tree``: a built-in name (``builtin_trees()``),
        a JSON file, a ``TokenTree``, or ``None`` for the checkpoint's ``medusa_tree`` (else
        ``mc_sim_7b_63``). The heads are loaded in the target's dtype and quantized with the target's
        scheme (``MedusaHeads.quantize(target.settings.quantization)``; see the module docstring)."""
        config = load_medusa_config(path)
        if target.lm.lm_head.in_features != target.config.hidden_size or target.config.output_vocab_size:
            raise ValueError("Medusa needs a target with a full-vocabulary LM head")
        # tied heads project with the target's head: a quantized one's values as it applies them
        lm_head = computed_weight(target.lm.lm_head) if config.tied_lm_head else None
        heads = load_heads(path, config, lm_head_weight=lm_head, dtype=target.dtype, device=target.device)
        heads.quantize(target.settings.quantization)      # as the target: ResBlocks its scheme, projections int8
        if tree is None:
            tree = config.tree if config.tree is not None else "mc_sim_7b_63"
        if not isinstance(tree, TokenTree):
            tree = load_tree(tree, num_heads=heads.num_heads)
        return cls(heads, tree, target, acceptance, **kwargs)

    # ------------------------------------------------------------------ what speculation reads
    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def batch_size(self) -> int:
        return self.target.batch_size

    @property
    def verify_size(self) -> int:
        """Tokens the target verifies per step: the tree's nodes and the root."""
        return self.tree.verify_size

    @property
    def depth(self) -> int:
        """Draft tokens a step can accept at most (the generator's k)."""
        return self.tree.depth

    def check_target(self, target: DecoderModel) -> None:
        if target is not self.target:
            raise ValueError("this MedusaDraft was loaded for another target: "
                             "use MedusaDraft.from_pretrained(path, target)")
        refuse_prefix_cache(target, "Medusa")

    def max_draft_tokens(self, length: int) -> int:
        """The tree's depth while the whole tree fits before ``n_positions``, else 0 (decode)."""
        return self.depth if self.target.n_positions - length >= self.tree.num_nodes else 0

    # ------------------------------------------------------------------ the proposer protocol
    def start(self, rows, prompts, params, rng, target_out) -> None:
        """Candidates for the first step from the context encoding's hidden state at each prompt's end."""
        slots = list(range(len(prompts))) if rows is None else rows
        last = torch.tensor([len(p) - 1 for p in prompts], device=target_out.hidden.device)
        hidden = target_out.hidden[torch.arange(len(prompts), device=last.device), last]
        self.candidates[torch.tensor(slots, device=self.candidates.device)] = \
            self.heads.candidates(hidden, self.tree.top_k).to(self.candidates.device)

    def propose(self, tail, lengths, k, params, rng) -> Proposal:
        nodes = gather_tree_tokens(tail[:, 1].to(self.candidates.device), self.candidates,
                                   self.buffers.candidate_index)[:, 1:]
        return Proposal(nodes, None, self.row_buffers)

    def accepted(self, lengths, verified) -> None:
        hidden = verified.target_out.hidden
        last = verified.last_node.to(hidden.device)
        self.candidates = self.heads.candidates(
            hidden.gather(1, last.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])).squeeze(1), self.tree.top_k)


def check_medusa(heads: MedusaHeads, tree: TokenTree, target: DecoderModel, acceptance: str) -> None:
    """ValueError when heads / tree / target / acceptance do not fit together (what, and what is allowed)."""
    if acceptance not in TREE_ACCEPTANCE:
        raise ValueError(f"acceptance={acceptance!r} is not supported; use one of {', '.join(TREE_ACCEPTANCE)}")
    if target.tp.size > 1:
        raise ValueError(f"Medusa needs a target at tp_degree=1 (got {target.tp.size}): "
                         "tensor-parallel Medusa is not supported yet")
    if heads.hidden_size != target.config.hidden_size:
        raise ValueError(f"Medusa heads have hidden size {heads.hidden_size} but the target "
                         f"{target.config.hidden_size}: the heads must be trained for this target")
    token_ids = getattr(heads, "token_ids", None)
    if token_ids is None and heads.vocab_size != target.vocab_size:
        raise ValueError(f"Medusa heads score {heads.vocab_size} tokens but the target's vocabulary has "
                         f"{target.vocab_size}")
    if tree.depth > heads.num_heads:
        raise ValueError(f"tree depth {tree.depth} exceeds the {heads.num_heads} Medusa heads")
    if tree.top_k > heads.vocab_size:
        raise ValueError(f"tree uses rank {tree.top_k - 1} but the heads score only {heads.vocab_size} tokens")
    largest = min(target.kv_buckets[-1], target.n_positions - 1)
    if tree.verify_size > largest:
        raise ValueError(f"the tree needs {tree.verify_size} verify slots (nodes + root) but the target allows "
                         f"{largest} (largest KV bucket {target.kv_buckets[-1]}, n_positions {target.n_positions})")
