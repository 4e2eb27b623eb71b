"""The strategy registry (``specdec.registry``) and the declared proposer protocol (``specdec.speculation.proposer``):
the table's invariants, renamed names refused with their new name, every proposer class declaring its
abilities, the error for a missing ability naming it, and every strategy of the registry giving the
target-only greedy output on the embedded model (with ``fused`` / ``adaptive`` / ``gate`` exactly where the
registry says they apply)."""
from __future__ import annotations

import argparse
import re

import pytest
import torch

from specdec import (
    DecoderModel,
    DraftModel,
    EagleDraft,
    EagleTreeDraft,
    LookupBranch,
    LookupOrDraft,
    MedusaDraft,
    PromptLookup,
    SpeculativeGenerator,
    shipped,
)
from specdec.core.chat import chat_ids
from specdec.registry import REGISTRY, RENAMED, SHIPPED, names, strategy
from specdec.speculation.proposer import ABILITIES, BaseProposer, MissingAbility, PlainProposer
from specdec.suffix import SuffixCache, SuffixChain, SuffixDraft, SuffixOrDraft

from conftest import load, prompt_ids
from test_engine import RepeatLastToken

PROPOSERS = [DraftModel, EagleDraft, EagleTreeDraft, MedusaDraft, PromptLookup, LookupOrDraft, LookupBranch,
             SuffixChain, SuffixDraft, SuffixOrDraft]
N_NEW = 8


# ---------------------------------------------------------------------------------------------- the table
def test_the_table_holds_its_invariants():
    assert list(REGISTRY) == ["none", "model", "eagle", "eagle-tree", "eagle3", "eagle3-tree", "medusa", "lookup",
                              "lookup+model", "lookup+eagle", "lookup+eagle-tree", "lookup+eagle3",
                              "lookup+eagle3-tree", "suffix", "suffix-tree", "suffix+model", "suffix+eagle",
                              "suffix+eagle3"]
    assert SHIPPED == ("model", "eagle", "eagle-tree", "eagle3", "eagle3-tree", "medusa")
    for name, s in REGISTRY.items():
        assert s.name == name and s.kind in ("none", "chain", "tree"), name
        assert (s.default_k is not None) == (s.kind == "chain"), name       # a tree's k is its depth
        assert (s.tree is not None) == (s.kind == "tree" and s.suffix is None), name   # suffix trees: no tree=
        assert s.adaptive == (s.kind == "chain") and s.gate == s.speculative, name
        assert not s.fused or (s.kind == "chain" and s.lookup is None), name
        assert (s.proposer is None) == (not s.speculative), name
        assert s.lookup is None or s.suffix is None, name
        if s.lookup in ("switch", "graft") or s.suffix == "switch":   # lookup+X / suffix+X: X's weights, tree,
            base = REGISTRY[name.split("+", 1)[1]]                      # quantization and k
            assert s.part == base.name and (s.weights, s.tree, s.quantizable, s.default_k) == \
                (base.weights, base.tree, base.quantizable, base.default_k), name
            assert s.proposer is (SuffixOrDraft if s.suffix else LookupBranch if base.kind == "tree" else
                                  LookupOrDraft), name
        assert (s.suffix is None) == (s.proposer not in (SuffixChain, SuffixDraft, SuffixOrDraft)), name
    for old, new in RENAMED.items():
        assert old not in REGISTRY and new in REGISTRY


def test_renamed_names_are_refused_with_the_new_one():
    from specdec.tools.bench import speculative as bench
    for old, new in RENAMED.items():
        with pytest.raises(ValueError, match=re.escape(f"strategy '{old}' is called '{new}' now")):
            strategy(old)
    with pytest.raises(ValueError, match="strategy 'draft' is called 'model' now"):
        shipped("draft", None)                  # refused before anything loads
    with pytest.raises(ValueError, match="no shipped strategy 'lookup'"):
        shipped("lookup", None)
    with pytest.raises(ValueError, match="strategy 'lookup\\+draft' is called 'lookup\\+model' now"):
        names("eagle,lookup+draft")
    assert names("eagle, lookup,eagle") == ["eagle", "lookup"]
    with pytest.raises(ValueError, match="does not run here"):
        names("none", allowed=bench.SPECULATIVE)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args([]).strategy == ["model"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--strategy", "draft"])


def test_build_refuses_options_a_strategy_does_not_take(ckpt):
    target = load(ckpt)
    with pytest.raises(ValueError, match="loads no draft network"):
        REGISTRY["lookup"].build(target, "some/path")
    with pytest.raises(ValueError, match="drafts chains: tree / depth are for the tree strategies"):
        REGISTRY["model"].build(target, ckpt.path, tree="3x8x8")
    with pytest.raises(ValueError, match="takes no quantization of its own"):
        REGISTRY["medusa"].build(target, ckpt.path, quantization="int8")
    assert REGISTRY["none"].build(target) is None
    assert isinstance(REGISTRY["lookup"].build(target), PromptLookup)
    with pytest.raises(ValueError, match="'lookup' is not suffix decoding"):
        REGISTRY["lookup"].build(target, suffix={"alpha": 2.0})
    with pytest.raises(ValueError, match="unknown suffix setting\\(s\\) 'min_match'; it takes cache, alpha"):
        REGISTRY["suffix"].build(target, suffix={"min_match": 3})
    cache = SuffixCache(max_tokens=1000)
    chain = REGISTRY["suffix"].build(target, suffix={"cache": cache, "alpha": 2.0})
    assert isinstance(chain, SuffixChain) and chain.cache is cache and chain.alpha == 2.0
    tree = REGISTRY["suffix-tree"].build(target, depth=3, suffix={"cache": cache, "num_nodes": 5})
    assert isinstance(tree, SuffixDraft) and tree.cache is cache and (tree.depth, tree.num_nodes) == (3, 5)
    with pytest.raises(ValueError, match="unknown suffix setting\\(s\\) 'min_match'; it takes .*num_nodes"):
        REGISTRY["suffix-tree"].build(target, suffix={"min_match": 3})
    with pytest.raises(ValueError, match="drafts chains: tree / depth"):
        REGISTRY["suffix"].build(target, depth=3)


# ---------------------------------------------------------------------------------------------- the protocol
@pytest.mark.parametrize("cls", PROPOSERS, ids=lambda c: c.__name__)
def test_every_proposer_class_declares_its_abilities(cls):
    """The methods a class declares are the ones it has (the attributes: ``check_declared`` on instances)."""
    assert issubclass(cls, BaseProposer) and cls.abilities <= set(ABILITIES), cls.abilities - set(ABILITIES)
    assert ("fused_drafter" in cls.abilities) == callable(cls.fused_drafter)
    for ability, method in [("check_target",) * 2, ("reread_width",) * 2, ("finished",) * 2, ("gate_drafts",) * 2,
                           ("deferred", "flush")]:
        assert (ability in cls.abilities) == (getattr(cls, method) is not getattr(BaseProposer, method)), method
    assert "pending" not in cls.abilities or "depth" in cls.abilities
    assert "padded" not in cls.abilities or "depth" not in cls.abilities
    assert "fused_drafter" not in cls.abilities or "model" in cls.abilities


def check_declared(proposer: BaseProposer) -> None:
    """An instance's ability attributes are set exactly when it declares them."""
    for name in ("depth", "verifier", "verify_size", "model", "draft", "fused_drafter", "cache"):
        assert (name in proposer.abilities) == (getattr(proposer, name) is not None), (type(proposer), name)
    if proposer.draft is not None:
        check_declared(proposer.draft)


def test_a_missing_ability_is_named(ckpt, checkpoint):
    target = load(ckpt, batch_size=1)
    lookup = PromptLookup(target)
    with pytest.raises(MissingAbility, match="the proposer ability 'fused_drafter'.*PromptLookup does not declare it"
                                             ": use fused=False") as e:
        SpeculativeGenerator(lookup, target, 3, fused=True)
    assert e.value.ability == "fused_drafter"
    with pytest.raises(MissingAbility, match="LookupBranch grafts onto a dynamic tree proposer.*'pending'") as e:
        LookupBranch(PromptLookup(target), lookup)
    assert e.value.ability == "pending"
    draft = DraftModel.from_pretrained(checkpoint("llama-draft").path, target, progress=False)
    for proposer in (lookup, draft, LookupOrDraft(PromptLookup(target), draft), SuffixDraft(target),
                     SuffixOrDraft(SuffixChain(target), draft)):
        check_declared(proposer)


def test_an_undeclared_object_runs_as_a_plain_chain_and_one_carrying_an_ability_is_refused(ckpt):
    target = load(ckpt, batch_size=1)
    plain = RepeatLastToken(target)
    gen = SpeculativeGenerator(plain, target, 2)
    assert isinstance(gen.proposer, PlainProposer) and gen.proposer.inner is plain and gen.proposer.abilities == set()
    prompt = prompt_ids(6, seed=2)
    assert torch.equal(gen.generate([prompt], max_new_tokens=6, eos_token_id=[]),
                       target.generate([prompt], max_new_tokens=6, eos_token_id=[]))
    with pytest.raises(MissingAbility, match="'fused_drafter'.*RepeatLastToken does not declare it"):
        SpeculativeGenerator(plain, target, 2, fused=True)

    class WithVerifier(RepeatLastToken):
        verifier = None       # an ability's attribute, undeclared: it would be ignored, so it is refused

    with pytest.raises(TypeError, match="WithVerifier has verifier: optional proposer abilities must be declared"):
        SpeculativeGenerator(WithVerifier(target), target, 2)


# ---------------------------------------------------------------------------------------------- every strategy
@pytest.fixture(scope="module")
def embedded(embedded_model):
    """The embedded model (eager), a prompt that repeats itself (prompt lookup finds n-grams), its greedy
    target-only continuation, and the draft networks built so far (one per model-backed strategy)."""
    target = DecoderModel.from_pretrained(None, n_positions=256, backend="eager", progress=False)
    ids = chat_ids(target.tokenizer, "Repeat after me: one two three, one two three, one two three.")
    return target, ids, target.generate([ids], max_new_tokens=N_NEW, eos_token_id=[]), {}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_strategy_gives_the_target_only_greedy_output(embedded, name):
    target, ids, reference, parts = embedded
    s = REGISTRY[name]
    if s.part is not None and s.part not in parts:      # lookup+X reuses X's network
        parts[s.part] = REGISTRY[s.part].build(target, progress=False)
    proposer = s.build(target, part=parts.get(s.part))
    if not s.speculative:
        assert proposer is None
        return
    assert type(proposer) is s.proposer and (proposer.depth is not None) == (s.kind == "tree")
    check_declared(proposer)
    settings = [{}] + [{flag: True} for flag in ("fused", "adaptive", "gate") if getattr(s, flag)]
    for kw in settings:
        gen = SpeculativeGenerator(proposer, target, s.default_k, **kw)
        out = gen.generate([ids], max_new_tokens=N_NEW, eos_token_id=[])
        assert torch.equal(out, reference), (name, kw)
        assert kw or gen.last_stats.drafted > 0
    if s.suffix is not None:        # every finished request entered the cache (the engine's "finished" hook)
        assert proposer.cache.stats()["added"] == len(settings), name
    for flag in ("fused", "adaptive"):      # what the registry says does not apply is refused
        if not getattr(s, flag):
            with pytest.raises(ValueError):
                SpeculativeGenerator(proposer, target, s.default_k, **{flag: True})
