"""Medusa speculation: heads (``heads``), static token trees (``tree``) and ``MedusaDraft`` (``draft``:
heads + tree bound to a target, the tree step of ``SpeculativeGenerator``).

The acceptance rules over trees are shared with other strategies in ``specdec.acceptance``
(``accept_tree_greedy``, ``accept_tree_sampled``, ``accept_tree_typical``).
"""
from .draft import MedusaDraft
from .heads import MedusaConfig, MedusaHeads, load_heads, load_medusa_config, save_heads
from .tree import (MedusaTree, TreeBuffers, build_tree, builtin_trees, expected_accept_length, gather_tree_tokens,
                   load_tree, measure_head_accuracy, save_tree, tree_buffers)

__all__ = [
    "MedusaConfig",
    "MedusaDraft",
    "MedusaHeads",
    "MedusaTree",
    "TreeBuffers",
    "build_tree",
    "builtin_trees",
    "expected_accept_length",
    "gather_tree_tokens",
    "load_heads",
    "load_medusa_config",
    "load_tree",
    "measure_head_accuracy",
    "save_heads",
    "save_tree",
    "tree_buffers",
]
