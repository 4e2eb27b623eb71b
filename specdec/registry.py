"""The strategy registry: every speculation strategy, by the one name the whole package uses.

    from specdec.registry import REGISTRY, strategy
    proposer = strategy("lookup+eagle").build(target)       # None for "none" (target only)
    SpeculativeGenerator(proposer, target, REGISTRY["lookup+eagle"].default_k)

The CLI (``--draft``), serving, the benchmarks (``bench-spec --strategy``, ``bench/*.py``), the sweeps
(``specdec.tools.experiments``) and ``shipped()`` read this table; nothing else lists strategies. Names: ``none``
(target only), ``model`` (a draft model), ``eagle`` / ``eagle3`` (EAGLE heads, chains) and ``eagle-tree`` /
``eagle3-tree`` (the same heads drafting EAGLE-2 dynamic trees), ``medusa``, ``lookup`` (prompt lookup),
``lookup+X``: prompt lookup combined with X's proposals, ``suffix`` (suffix decoding: the row's text and a
cache of earlier requests, chains), ``suffix-tree`` (the same, token trees of the most frequent continuations)
and ``suffix+X``: the suffix chain where it matches, X's chain elsewhere.
``RENAMED`` holds the names of earlier tables, which
are refused with the new name (``strategy``).

Invariants (``tests/test_registry.py``): a strategy's ``kind`` is that of the proposer ``build`` returns
("tree" ⇔ its ``depth`` is declared); ``default_k`` is set exactly for chains (a tree's k is its depth);
``fused`` ⇔ the proposer declares ``fused_drafter``; ``adaptive`` ⇔ an unfused chain; every speculative
strategy gates; ``lookup+X`` / ``suffix+X`` have X's weights, tree option and quantization, and ``part`` = X;
a suffix strategy's proposer declares its ``cache``; greedy output of every strategy equals target-only decoding.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .core.decoder import DecoderModel
from .draft.proposer import DraftModel
from .draft.smollm2 import embedded_draft_path
from .eagle.proposer import EagleDraft
from .eagle.smollm2 import embedded_eagle_path, shipped_eagle3_dir
from .eagle.tree import DynamicTree, EagleTreeDraft
from .lookup.branch import LookupBranch
from .lookup.combined import LookupOrDraft
from .lookup.proposer import PromptLookup
from .medusa.draft import MedusaDraft
from .medusa.heads import load_medusa_config
from .medusa.smollm2 import shipped_medusa_dir
from .speculation.proposer import BaseProposer
from .suffix.combined import SuffixOrDraft
from .suffix.proposer import SuffixChain, SuffixDraft


@dataclass(frozen=True)
class Strategy:
    """One speculation strategy.

    name: its name everywhere; summary: one line for help texts and tables; proposer: the class ``build``
    returns (None: target only); kind: "none" (target only), "chain" or "tree"; default_k: draft tokens per
    step when none is given (chains; a tree's k is its depth); part: the strategy whose weights it loads
    (itself for a model-backed strategy, X for ``lookup+X`` / ``suffix+X``, None: no weights); lookup: how
    prompt lookup takes part ("alone", "switch": per row, lookup or the model's chain (``LookupOrDraft``),
    "graft": the lookup chain grafted onto the model's tree (``LookupBranch``), None); suffix: how suffix
    decoding takes part ("alone": ``SuffixChain``, "tree": ``SuffixDraft``'s token trees, "switch": per row, the
    suffix chain or the model's (``SuffixOrDraft``), None); tree: the ``tree=`` it takes
    ("static": a Medusa tree name / JSON / ``TokenTree``, "dynamic": a ``DynamicTree`` or "DxKxN", None);
    fused / adaptive / gate: whether ``SpeculativeGenerator``'s ``fused=`` / ``adaptive=`` / ``gate=`` apply;
    quantizable: its draft network takes its own weight-only scheme (``quantization=``); weights: the
    shipped checkpoint for the embedded model (a function returning a loadable path; None: none shipped);
    load: ``(path, target, **options) -> proposer`` for a model-backed strategy; max_depth: the deepest
    tree its shipped weights draft (None: no limit).
    """

    name: str
    summary: str
    proposer: type[BaseProposer] | None
    kind: str = "chain"
    default_k: int | None = None
    part: str | None = None
    lookup: str | None = None
    suffix: str | None = None
    tree: str | None = None
    fused: bool = False
    adaptive: bool = False
    gate: bool = True
    quantizable: bool = False
    weights: Callable[[], Path] | None = None
    load: Callable[..., BaseProposer] | None = None
    max_depth: Callable[[], int] | None = None

    @property
    def speculative(self) -> bool:
        return self.kind != "none"

    @property
    def shipped(self) -> bool:
        """Whether ``shipped(name, target)`` loads it: a model-backed strategy with shipped weights."""
        return self.weights is not None and self.part == self.name

    def build(self, target: DecoderModel, path: str | Path | None = None, *, part: BaseProposer | None = None,
              tree: Any = None, depth: int | None = None, suffix: Mapping[str, Any] | None = None,
              **options) -> BaseProposer | None:
        """The strategy's proposer for ``target`` (None for "none").

        path: the checkpoint of the draft network (None: the shipped weights, trained for the embedded
        model); part: an already built proposer of ``self.part`` to use instead of loading one (so one
        draft network serves several strategies); tree: a tree strategy's tree (``Strategy.tree``);
        depth: a tree strategy's depth (Medusa: the tree cut to it; EAGLE-2: ``DynamicTree(depth=...)``);
        suffix: a suffix strategy's settings: ``SuffixChain``'s (``SUFFIX_OPTIONS``: ``cache``, a ``SuffixCache``
        (e.g. one shared with other proposers; default: a new one), ``alpha``, ``offset``, ``min_prob``,
        ``cache_prompts``), for ``suffix-tree`` also ``SuffixDraft``'s ``num_nodes`` (its ``depth``: ``depth``) and
        for ``suffix+X`` ``SuffixOrDraft``'s ``min_match``;
        options: the draft network's ``from_pretrained`` arguments (``quantization``, ``progress``, ...)."""
        if self.part is None and (path is not None or part is not None or options):
            raise ValueError(f"strategy {self.name!r} loads no draft network: it takes no path or options")
        if self.kind != "tree" and (tree is not None or depth is not None):
            raise ValueError(f"strategy {self.name!r} drafts chains: tree / depth are for the tree strategies "
                             f"({', '.join(n for n, s in REGISTRY.items() if s.kind == 'tree')})")
        if self.tree is None and tree is not None:
            raise ValueError(f"strategy {self.name!r} grows its trees from the text it matched: it takes a depth and "
                             "suffix={'num_nodes': N}, not a tree")
        if suffix is not None:
            self._check_suffix(suffix)
        if self.kind == "none":
            return None
        if self.lookup == "alone":
            return PromptLookup(target)
        if self.suffix == "alone":
            return SuffixChain(target, **(suffix or {}))
        if self.suffix == "tree":
            return SuffixDraft(target, **(suffix or {}), **({} if depth is None else {"depth": depth}))
        if part is None:
            part = REGISTRY[self.part]._load(target, path, tree, depth, options)
        if self.lookup == "switch":
            return LookupOrDraft(PromptLookup(target), part)
        if self.lookup == "graft":
            return LookupBranch(PromptLookup(target), part, part.depth)
        if self.suffix == "switch":
            chain = {k: v for k, v in (suffix or {}).items() if k in SUFFIX_OPTIONS}
            switch = {k: v for k, v in (suffix or {}).items() if k not in SUFFIX_OPTIONS}
            return SuffixOrDraft(SuffixChain(target, **chain), part, **switch)
        return part

    def _check_suffix(self, suffix: Mapping[str, Any]) -> None:
        """ValueError unless ``suffix`` holds settings this strategy takes."""
        if self.suffix is None:
            raise ValueError(f"strategy {self.name!r} is not suffix decoding: suffix settings are for "
                             f"{', '.join(n for n, s in REGISTRY.items() if s.suffix)}")
        allowed = SUFFIX_OPTIONS + {"switch": ("min_match",), "tree": ("num_nodes",)}.get(self.suffix, ())
        unknown = [k for k in suffix if k not in allowed]
        if unknown:
            raise ValueError(f"strategy {self.name!r}: unknown suffix setting(s) {', '.join(map(repr, unknown))}; "
                             f"it takes {', '.join(allowed)}")

    def _load(self, target: DecoderModel, path, tree, depth, options: dict) -> BaseProposer:
        if path is None:
            if self.weights is None:
                raise ValueError(f"strategy {self.name!r} has no shipped weights: give the path of a checkpoint")
            path = self.weights()
        if self.tree is not None:
            options = {**options, "tree": tree, "depth": depth}
        if "quantization" in options and not self.quantizable:
            raise ValueError(f"strategy {self.name!r}: its draft takes no quantization of its own (Medusa heads "
                             "follow the target's)")
        return self.load(path, target, **options)


def _eagle_tree(path, target: DecoderModel, *, tree=None, depth: int | None = None, **kwargs) -> EagleTreeDraft:
    """``EagleTreeDraft.from_pretrained`` with ``tree`` given as "DxKxN" too, and ``depth`` replacing its depth."""
    tree = DynamicTree.parse(tree) if isinstance(tree, str) else tree or DynamicTree()
    return EagleTreeDraft.from_pretrained(path, target, tree=tree if depth is None else replace(tree, depth=depth),
                                          **kwargs)


def _medusa(path, target: DecoderModel, *, tree=None, depth: int | None = None, progress: bool | None = None,
            **kwargs) -> MedusaDraft:
    """``MedusaDraft.from_pretrained`` with its tree cut to ``depth`` (None: the whole tree); ``progress``
    is ignored (the heads load at once, on the target's runtime)."""
    full = MedusaDraft.from_pretrained(path, target, tree=tree, **kwargs)
    if depth is None or depth == full.depth:
        return full
    if depth > full.depth:
        raise ValueError(f"k={depth}: the Medusa tree has depth {full.depth} (k is the depth it is cut to)")
    return MedusaDraft(full.heads, full.tree.truncated(depth), target)


def _shipped_medusa_depth() -> int:
    tree = load_medusa_config(shipped_medusa_dir()).tree
    return tree.depth if tree is not None else 1


def _embedded_eagle3_path() -> Path:
    return embedded_eagle_path(shipped_eagle3_dir())


def _loader(cls: type) -> Callable[..., BaseProposer]:
    def load(path, target: DecoderModel, **kwargs) -> BaseProposer:
        return cls.from_pretrained(path, target, **kwargs)
    return load


def _model_backed() -> list[Strategy]:
    eagle, eagle3 = embedded_eagle_path, _embedded_eagle3_path
    chain = dict(kind="chain", fused=True, adaptive=True, quantizable=True)
    dynamic = dict(kind="tree", tree="dynamic", quantizable=True, load=_eagle_tree)
    return [
        Strategy("model", "a draft model (a small model with the target's tokenizer)", DraftModel, default_k=4,
                 weights=embedded_draft_path, load=_loader(DraftModel), **chain),
        Strategy("eagle", "an EAGLE head drafting chains", EagleDraft, default_k=5, weights=eagle,
                 load=_loader(EagleDraft), **chain),
        Strategy("eagle-tree", "an EAGLE head drafting EAGLE-2 dynamic trees", EagleTreeDraft, weights=eagle,
                 **dynamic),
        Strategy("eagle3", "the EAGLE-3 head drafting chains", EagleDraft, default_k=5, weights=eagle3,
                 load=_loader(EagleDraft), **chain),
        Strategy("eagle3-tree", "the EAGLE-3 head drafting EAGLE-2 dynamic trees", EagleTreeDraft, weights=eagle3,
                 **dynamic),
        Strategy("medusa", "Medusa heads and a static token tree", MedusaDraft, kind="tree", tree="static",
                 weights=shipped_medusa_dir, load=_medusa, max_depth=_shipped_medusa_depth),
    ]


def _with_lookup(base: Strategy) -> Strategy:
    """``lookup+X``: prompt lookup where the sequence repeats itself, X elsewhere (chains, per row), or the
    lookup continuation grafted onto X's dynamic trees."""
    graft = base.kind == "tree"
    return replace(base, name=f"lookup+{base.name}", part=base.name, lookup="graft" if graft else "switch",
                   proposer=LookupBranch if graft else LookupOrDraft, fused=False, load=None, max_depth=None,
                   summary=f"{base.name} with the prompt-lookup continuation grafted onto its trees" if graft
                   else f"prompt lookup where the sequence repeats a 2-gram, {base.name} elsewhere")


def _with_suffix(base: Strategy) -> Strategy:
    """``suffix+X``: the suffix chain where the row's text or the cache matches, X's chain elsewhere (per row)."""
    return replace(base, name=f"suffix+{base.name}", part=base.name, suffix="switch", proposer=SuffixOrDraft,
                   fused=False, load=None, max_depth=None,
                   summary=f"suffix decoding where the text matches (4+ tokens), {base.name} elsewhere")


SUFFIX_OPTIONS = ("cache", "alpha", "offset", "min_prob", "cache_prompts")
"""The ``SuffixChain`` settings ``Strategy.build(suffix=...)`` takes (``suffix+X`` also ``min_match``)."""


def _table() -> dict[str, Strategy]:
    models = [replace(s, part=s.name) for s in _model_backed()]
    lookup = Strategy("lookup", "prompt lookup (n-grams of the sequence itself, no weights)", PromptLookup,
                      default_k=4, lookup="alone", adaptive=True)
    suffix = Strategy("suffix", "suffix decoding (the sequence and a cache of earlier outputs, no weights)",
                      SuffixChain, default_k=4, suffix="alone", adaptive=True)
    suffix_tree = Strategy("suffix-tree", "suffix decoding drafting token trees of the most frequent continuations",
                           SuffixDraft, kind="tree", suffix="tree")
    none = Strategy("none", "target only (no speculation)", None, kind="none", gate=False)
    combined = [_with_lookup(s) for s in models if s.name != "medusa"]
    with_suffix = [_with_suffix(s) for s in models if s.kind == "chain"]
    return {s.name: s for s in [none, *models, lookup, *combined, suffix, suffix_tree, *with_suffix]}


REGISTRY: dict[str, Strategy] = _table()
"""Every strategy by name: none, model, eagle, eagle-tree, eagle3, eagle3-tree, medusa, lookup, lookup+model,
lookup+eagle, lookup+eagle-tree, lookup+eagle3, lookup+eagle3-tree, suffix, suffix-tree, suffix+model, suffix+eagle,
suffix+eagle3."""
RENAMED = {"draft": "model", "lookup+draft": "lookup+model", "target": "none"}
"""Names of the earlier per-tool tables → the registry's name."""
SHIPPED = tuple(name for name, s in REGISTRY.items() if s.shipped)
"""The strategies ``shipped()`` loads: model, eagle, eagle-tree, eagle3, eagle3-tree, medusa."""


def strategy(name: str) -> Strategy:
    """The strategy called ``name``; ValueError naming the new name of a renamed one, or the choices."""
    if name in REGISTRY:
        return REGISTRY[name]
    if name in RENAMED:
        raise ValueError(f"strategy {name!r} is called {RENAMED[name]!r} now")
    raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(REGISTRY)}")


def names(text: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    """A comma list of strategy names (``strategy`` checks each; ``allowed``: the ones a tool runs), in
    order, without repeats; ValueError for an unknown or renamed name or an empty list."""
    out = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    if not out:
        raise ValueError(f"no strategy in {text!r}")
    for name in out:
        strategy(name)
        if allowed is not None and name not in allowed:
            raise ValueError(f"strategy {name!r} does not run here; choose among {', '.join(allowed)}")
    return out


def name_list(allowed: tuple[str, ...] | None = None) -> Callable[[str], list[str]]:
    """An argparse ``type``: ``names`` with its ValueError as the argument's error message."""
    def parse(text: str) -> list[str]:
        try:
            return names(text, allowed)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = "strategies"
    return parse
