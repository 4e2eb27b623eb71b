"""Medusa speculation: heads (``heads``), Medusa's trees (``tree``: built-in trees, tree construction)
and ``MedusaDraft`` (``draft``: heads + tree bound to a target, a tree proposer).

The tree structure (``specdec.speculation.tree``), tree verification
(``specdec.speculation.verify.TreeVerifier``) and the acceptance rules over trees
(``specdec.speculation.acceptance``) are shared with other tree strategies.
"""
from .draft import MedusaDraft
from .heads import MedusaConfig, MedusaHeads, load_heads, load_medusa_config, save_heads
from .tree import (
                   build_tree,
                   builtin_trees,
                   expected_accept_length,
                   gather_tree_tokens,
                   load_tree,
                   measure_head_accuracy,
                   save_tree,
)

__all__ = [
    "MedusaConfig",
    "MedusaDraft",
    "MedusaHeads",
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
]
