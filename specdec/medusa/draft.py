"""``MedusaDraft``: Medusa heads + a static token tree bound to a target, and one tree step.

Use it like any draft: ``SpeculativeGenerator(MedusaDraft.from_pretrained(path, target, tree=...), target)``.

One step, per row (S = prompt + emitted tokens; the target's cache holds S[:-1]; the heads' top-k
candidates were computed from the target's hidden state of the position that produced S[-1]):
  1. tree tokens [B, N+1] = root S[-1], then each node's candidate (``gather_tree_tokens``);
  2. one target forward of the multi-token graph over the N+1 nodes at slots len(S)-1 .. len(S)-1+N,
     RoPE positions len(S)-1 + depth, attention among them by the tree mask: the target's
     distribution (or argmax) after every node and the hidden state of every node;
  3. acceptance on the tree (``specdec.acceptance``: greedy, lossless multi-draft rejection, or the
     lossy typical rule) → accepted depth n, last accepted node, the n + 1 emitted tokens;
  4. KV compaction: the cache rows of the accepted path's nodes (slots len(S)-1 + node) move to the
     contiguous slots len(S) .. len(S)-1+n (one gather + one scatter per layer, on device); the
     loop then sets the target's length to len(S) + n;
  5. the next step's candidates: the heads applied to the hidden state of the last accepted node —
     from the same forward, no extra target pass.
When fewer than N+1 slots are left before ``n_positions``, a step verifies the root alone (a plain
decode step: 1 token).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..acceptance import accept_tree_greedy, accept_tree_sampled, accept_tree_typical, draw_tree_uniforms
from ..core.decoder import DecoderModel
from .heads import MedusaHeads, load_heads, load_medusa_config
from .tree import MedusaTree, gather_tree_tokens, load_tree, tree_buffers

ACCEPTANCE = ("lossless", "typical")


class MedusaDraft:
    """Medusa heads and a tree for ``target`` (a ``DecoderModel`` at tp_degree 1).

    ``acceptance``: 'lossless' (greedy rows: the longest path matching the target argmax; sampled rows:
    recursive rejection over siblings, the target's distribution exactly) or 'typical' (Medusa's typical
    acceptance: NOT lossless, changes the output distribution of sampled rows; ``typical_epsilon`` /
    ``typical_delta`` are Medusa's posterior_threshold / posterior_alpha).
    """

    def __init__(self, heads: MedusaHeads, tree: MedusaTree, target: DecoderModel, acceptance: str = "lossless",
                 typical_epsilon: float = 0.09, typical_delta: float = 0.3):
        check_medusa(heads, tree, target, acceptance)
        self.heads = heads.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
        self.tree, self.target, self.acceptance = tree, target, acceptance
        self.typical = (typical_epsilon, typical_delta)
        self.buffers = tree_buffers(tree, target.device)
        self.candidates: torch.Tensor | None = None   # [B, num_heads, top_k] for the next step

    @classmethod
    def from_pretrained(cls, path: str | Path | None, target: DecoderModel, *, tree: str | Path | MedusaTree | None = None,
                        acceptance: str = "lossless", **kwargs) -> "MedusaDraft":
        """Load heads in the FasterDecoding/Medusa layout (``None``: the heads shipped for the embedded
        SmolLM2). ``tree``: a built-in name (``builtin_trees()``), a JSON file, a ``MedusaTree``, or
        ``None`` for the checkpoint's ``medusa_tree`` (else ``mc_sim_7b_63``)."""
        if path is None:
            from .smollm2 import SHIPPED_MEDUSA
            path = SHIPPED_MEDUSA
        config = load_medusa_config(path)
        lm_head = target.lm.lm_head.weight.detach()
        if lm_head.shape[1] != target.config.hidden_size or target.config.output_vocab_size:
            raise ValueError("Medusa needs a target with a full-vocabulary LM head")
        heads = load_heads(path, config, lm_head_weight=lm_head if config.tied_lm_head else None,
                           dtype=target.dtype, device=target.device)
        if tree is None:
            tree = config.tree if config.tree is not None else "mc_sim_7b_63"
        if not isinstance(tree, MedusaTree):
            tree = load_tree(tree, num_heads=heads.num_heads)
        return cls(heads, tree, target, acceptance, **kwargs)

    # ------------------------------------------------------------------ what the loop reads
    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def batch_size(self) -> int:
        return self.target.batch_size

    @property
    def depth(self) -> int:
        """Draft tokens a step can accept at most (the loop's k)."""
        return self.tree.depth

    # ------------------------------------------------------------------ the step
    def start(self, prompts: list[torch.Tensor], target_out) -> None:
        """Candidates for the first step from the context encoding's hidden state at each prompt's end."""
        last = torch.tensor([len(p) - 1 for p in prompts] + [0] * (self.batch_size - len(prompts)))
        hidden = target_out.hidden[torch.arange(self.batch_size), last.to(target_out.hidden.device)]
        self.candidates = self.heads.candidates(hidden, self.tree.top_k)

    def step(self, root: torch.Tensor, lengths: torch.Tensor, params: torch.Tensor,
             generator: torch.Generator | None, greedy: bool, stats) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One tree step (module docstring) for root tokens [B] = S[-1] and lengths [B] = len(S).

        Returns (num_accepted [B], emitted [B, n+1 used, -1 after], drafted depth). The target's length
        is left at len(S) - 1; the caller moves it to len(S) + num_accepted.
        """
        target, buf = self.target, self.buffers
        base = lengths.to(target.device) - 1          # slot (and position) of the root
        room = target.n_positions - int(lengths.max())
        nodes = self.tree.verify_size if room >= self.tree.num_nodes else 1
        with stats.timer("verify"):
            target.set_lengths(lengths - 1)
            tokens = gather_tree_tokens(root.to(target.device), self.candidates, buf.candidate_index)[:, :nodes]
            positions = base.unsqueeze(1) + buf.depth[:nodes]
            out = target.step(tokens, params, generator, token_mask=buf.mask[:nodes, :nodes], position_ids=positions,
                              advance=False, return_probs=not greedy and nodes > 1)
        with stats.timer("other"):
            if nodes == 1:   # no room for the tree: the root's own decode step
                n = torch.zeros(self.batch_size, dtype=torch.long, device=target.device)
                best, emitted = n, out.tokens[:, :1]
            else:
                n, best, emitted = self._accept(tokens, out, greedy, generator)
                self._compact(base, best, n)
        with stats.timer("draft"):
            hidden = out.hidden.gather(1, best.view(-1, 1, 1).expand(-1, 1, out.hidden.shape[-1])).squeeze(1)
            self.candidates = self.heads.candidates(hidden, self.tree.top_k)
        return n.cpu(), emitted.cpu(), self.depth if nodes > 1 else 0

    def _accept(self, tokens: torch.Tensor, out, greedy: bool, generator):
        buf = self.buffers
        if greedy:
            return accept_tree_greedy(tokens, out.tokens, buf.parent, buf.ancestors)
        uniform, residual = draw_tree_uniforms(self.batch_size, buf.max_depth, buf.max_children, generator,
                                               device=self.target.device)
        if self.acceptance == "typical":
            eps, delta = self.typical
            return accept_tree_typical(tokens, out.probs, buf.parent, buf.ancestors, residual, epsilon=eps, delta=delta)
        return accept_tree_sampled(tokens, out.probs, buf.child_nodes, uniform, residual)

    def _compact(self, base: torch.Tensor, best: torch.Tensor, n: torch.Tensor) -> None:
        """Move the accepted path's KV rows (slots base + node) to slots base + 1 .. base + n."""
        D = self.buffers.max_depth
        depth = torch.arange(1, D + 1, device=base.device)
        path = self.buffers.ancestors.index_select(0, best)[:, 1:]                  # [B, D]
        keep = depth.unsqueeze(0) <= n.unsqueeze(1)
        dst = base.unsqueeze(1) + depth
        src = torch.where(keep, base.unsqueeze(1) + path.clamp(min=0), dst)     # unaccepted depths: no-op
        self.target.copy_cache_slots(src, dst)


def check_medusa(heads: MedusaHeads, tree: MedusaTree, target: DecoderModel, acceptance: str) -> None:
    """ValueError when heads / tree / target / acceptance do not fit together (what, and what is allowed)."""
    if acceptance not in ACCEPTANCE:
        raise ValueError(f"acceptance={acceptance!r} is not supported; use one of {', '.join(ACCEPTANCE)}")
    if target.tp.size > 1:
        raise ValueError(f"Medusa needs a target at tp_degree=1 (got {target.tp.size}): "
                         "tensor-parallel Medusa is not supported yet")
    if heads.hidden_size != target.config.hidden_size:
        raise ValueError(f"Medusa heads have hidden size {heads.hidden_size} but the target {target.config.hidden_size}: "
                         "the heads must be trained for this target")
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
