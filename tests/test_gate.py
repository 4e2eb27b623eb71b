"""Speculate only while it pays (``specdec.speculation.gate``): the policy, greedy identity with target-only when the
gate mixes speculative and plain steps (draft model, prompt lookup, EAGLE-2 trees with the lookup branch;
batch 3 and 1), a gate that turns slow speculation off and keeps fast speculation on, a combination's model
drafting at misses only while it pays, chi-square
losslessness of mixed steps, and the API / CLI / bench-spec boundaries."""
import pytest
import torch

from specdec import CostGate, SpeculativeGenerator
from specdec.speculation.gate import GateMeter

from conftest import load
from test_adaptive import PROMPTS, proposer
from test_eagle3 import tiny  # noqa: F401
from test_speculative import lossless_models, lossless_pvalue  # noqa: F401


class Clock:
    """A fake clock: every reading advances it by 1; ``charge`` adds time (a slow draft call)."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t

    def charge(self, seconds: float) -> None:
        self.t += seconds


def record_kinds(gen: SpeculativeGenerator, meter: GateMeter | None = None) -> list[bool]:
    """Wrap the meter's ``record`` (default: the generator's gate): one entry per step, True for a speculative
    step (a combination's ``draft_meter``: a step at a miss where the model drafted)."""
    kinds, meter = [], meter or gen.gate_meter
    record = meter.record

    def recorded(speculated, tokens, seconds):
        kinds.append(speculated)
        record(speculated, tokens, seconds)
    meter.record = recorded
    return kinds


def record_decisions(gen: SpeculativeGenerator) -> list[bool]:
    """Wrap the meter's ``speculate``: one entry per step, True where the gate let it speculate (a padded
    proposer's step without drafts is still a plain step, which ``record`` sees)."""
    decisions, meter = [], gen.gate_meter
    speculate = meter.speculate

    def decided():
        decisions.append(speculate())
        return decisions[-1]
    meter.speculate = decided
    return decisions


def slowed(proposer, meter: GateMeter, seconds: float) -> list[bool]:
    """Every ``proposer.propose`` call costs ``seconds`` more on a fake ``Clock``, which ``meter`` reads → one
    entry per call."""
    propose, clock, calls = proposer.propose, Clock(), []

    def slow(*args, **kwargs):
        clock.charge(seconds)
        calls.append(True)
        return propose(*args, **kwargs)
    proposer.propose = slow
    meter.clock = clock
    return calls


# ---------------------------------------------------------------- the policy

def test_policy_warms_up_both_kinds_then_prefers_the_faster_and_probes_the_other():
    meter = GateMeter(CostGate(probe_every=4, smoothing=0.5, warmup=2))
    warm = []
    for tokens, seconds in [(1, 3.0), (4, 1.0), (11, 3.0), (4, 1.0)]:   # speculative: 12 tokens in 6 s
        warm.append(meter.speculate())
        meter.record(warm[-1], tokens, seconds)
    assert warm == [True, False, True, False]
    assert meter.rate(True) == pytest.approx(2.0) and meter.rate(False) == pytest.approx(4.0)  # ratios of means
    choices = []
    for _ in range(4 + 8 + 16):
        kind = meter.speculate()
        choices.append(kind)
        meter.record(kind, 6 if kind else 4, 3.0 if kind else 1.0)
    # a speculative probe after 3 plain steps; each probe that confirms plain doubles the spacing
    assert choices == [False] * 3 + [True] + [False] * 7 + [True] + [False] * 15 + [True]
    assert meter.spacing == 32 and meter.steps == {True: 5, False: 27}
    meter.record(True, 60, 1.0)          # speculation got fast: (3 + 30) / (1.5 + 0.5) tokens/s
    assert meter.rate(True) == pytest.approx(33 / 2) and meter.speculate() and meter.spacing == 4
    capped = GateMeter(CostGate(probe_every=2, max_probe_every=4))
    for _ in range(40):
        kind = capped.speculate()
        capped.record(kind, 1 if kind else 4, 1.0)
    assert capped.spacing == 4
    meter.reset()                        # forgets everything: warms up again, speculative first
    assert meter.steps == {True: 0, False: 0} and meter.rate(True) is None and meter.spacing == 4
    assert meter.speculate() and meter.preferred() is None


def test_cost_gate_validation(checkpoint):
    for kw in [dict(probe_every=1), dict(probe_every=2.0), dict(probe_every=True), dict(smoothing=0),
               dict(smoothing=1.5), dict(smoothing="0.2"), dict(probe_every=8, max_probe_every=4), dict(warmup=0)]:
        with pytest.raises(ValueError, match="CostGate"):
            CostGate(**kw)
    target = load(checkpoint("llama"), batch_size=1)
    draft = load(checkpoint("llama-draft"), batch_size=1)
    with pytest.raises(ValueError, match="gate runs unfused"):
        SpeculativeGenerator(draft, target, 3, fused=True, gate=True)
    with pytest.raises(ValueError, match="gate must be True, False or a CostGate"):
        SpeculativeGenerator(draft, target, 3, gate="on")
    assert SpeculativeGenerator(draft, target, 3).gate_meter is None
    assert SpeculativeGenerator(draft, target, 3, gate=CostGate(5)).gate_meter.gate == CostGate(5)


# ---------------------------------------------------------------- greedy identity, the gate's choice

@pytest.mark.parametrize("kind", ["draft", "lookup", "lookup+draft"])
def test_greedy_equals_target_only_with_mixed_steps(checkpoint, kind):
    """probe_every=2: after the first two steps the kinds alternate, so both run for every row."""
    target = load(checkpoint("llama"), batch_size=3)
    reference = target.generate(PROMPTS, max_new_tokens=40, eos_token_id=[])
    gen = SpeculativeGenerator(proposer(kind, target, load(checkpoint("llama-draft"), batch_size=3)), target, 4,
                               gate=CostGate(probe_every=2, max_probe_every=2))
    kinds = record_kinds(gen)
    assert torch.equal(gen.generate(PROMPTS, max_new_tokens=40, eos_token_id=[]), reference)
    assert kinds.count(True) >= 3 and kinds.count(False) >= 3
    assert gen.gate_meter.steps == {True: kinds.count(True), False: kinds.count(False)}
    single = load(checkpoint("llama"), batch_size=1)
    alone = SpeculativeGenerator(proposer(kind, single, load(checkpoint("llama-draft"), batch_size=1)), single, 4,
                                 gate=CostGate(probe_every=2, max_probe_every=2))
    width = max(map(len, PROMPTS))
    out = alone.generate([PROMPTS[2]], max_new_tokens=40, eos_token_id=[])
    assert torch.equal(out[0, len(PROMPTS[2]):], reference[2, width:])


def test_slow_speculation_is_turned_off_and_fast_speculation_kept(checkpoint):
    """A draft step that costs 50 decode steps: after measuring both kinds the gate decodes plainly,
    with one speculative probe per probe_every steps; free drafting keeps speculating (prompt lookup on
    a target that loops accepts runs of drafts). Either way the output is target-only greedy."""
    target = load(checkpoint("llama"), batch_size=3)
    reference = target.generate(PROMPTS, max_new_tokens=60, eos_token_id=[])
    draft = load(checkpoint("llama-draft"), batch_size=3)
    slow = SpeculativeGenerator(proposer("draft", target, draft), target, 4, gate=True)
    slowed(slow.proposer, slow.gate_meter, 50.0)
    kinds = record_kinds(slow)
    assert torch.equal(slow.generate(PROMPTS, max_new_tokens=60, eos_token_id=[]), reference)
    assert kinds[:8] == [True, False] * 4
    assert kinds[8:].count(True) <= len(kinds[8:]) // 16 + 1 and len(kinds) > 20
    fast = SpeculativeGenerator(proposer("lookup", target, draft), target, 4, gate=True)
    slowed(fast.proposer, fast.gate_meter, 0.0)
    kinds = record_decisions(fast)
    assert torch.equal(fast.generate(PROMPTS, max_new_tokens=60, eos_token_id=[]), reference)
    assert kinds[0] and kinds.count(True) >= 0.8 * len(kinds)          # (rows finishing: fewer tokens)


def test_a_combination_drafts_with_its_model_at_misses_only_while_that_pays(checkpoint):
    """lookup + draft with the gate: the steps where some row's lookup has no match ("misses") are measured in
    two kinds, the model drafting for those rows or not. Both kinds run (probe_every=2) with greedy output equal
    to target-only; a draft that costs 50 decode steps stops drafting after the warm-up (one probe per
    probe_every misses) while the lookup's own drafts keep being verified; a combination without the gate
    drafts with the model at every miss (no ``draft_meter``)."""
    target = load(checkpoint("llama"), batch_size=3)
    reference = target.generate(PROMPTS, max_new_tokens=60, eos_token_id=[])
    draft = load(checkpoint("llama-draft"), batch_size=3)
    mixed = SpeculativeGenerator(proposer("lookup+draft", target, draft), target, 4,
                                 gate=CostGate(probe_every=2, max_probe_every=2))
    kinds = record_kinds(mixed, mixed.proposer.draft_meter)
    assert torch.equal(mixed.generate(PROMPTS, max_new_tokens=60, eos_token_id=[]), reference)
    assert kinds.count(True) >= 3 and kinds.count(False) >= 3

    slow = SpeculativeGenerator(proposer("lookup+draft", target, draft), target, 4, gate=True)
    slow.gate_meter.speculate = lambda: True       # every step speculative: only the drafts' meter chooses
    meter = slow.draft_meter
    assert meter is slow.proposer.draft_meter
    drafted = slowed(slow.proposer.draft, meter, 50.0)
    kinds = record_kinds(slow, meter)
    verified = []
    step = slow.speculator.verifier.verify
    slow.speculator.verifier.verify = lambda *a, **kw: verified.append(True) or step(*a, **kw)
    assert torch.equal(slow.generate(PROMPTS, max_new_tokens=60, eos_token_id=[]), reference)
    assert kinds[:8] == [True, False] * 4 and len(kinds) > 20
    assert kinds[8:].count(True) <= len(kinds[8:]) // 16 + 1
    assert len(drafted) == kinds.count(True)            # the model drafts at a miss only when the gate says so
    assert len(verified) > len(drafted)                 # the lookup's drafts were verified without it
    assert SpeculativeGenerator(proposer("lookup+draft", target, draft), target, 4).proposer.draft_meter is None
    slow.reset_gate()       # both meters forget: the next request warms up both kinds again
    assert slow.gate_meter.steps == meter.steps == {True: 0, False: 0}
    kinds.clear()
    assert torch.equal(slow.generate(PROMPTS, max_new_tokens=60, eos_token_id=[]), reference)
    assert kinds[:8] == [True, False] * 4


def test_greedy_tree_with_lookup_branch_equals_target_only_with_mixed_steps(tiny):
    from specdec import DynamicTree, EagleTreeDraft, LookupBranch, PromptLookup

    from test_eagle import PROMPTS as EAGLE_PROMPTS
    from test_eagle import load_target
    target = load_target(tiny["target_dir"])
    tree = EagleTreeDraft.from_pretrained(tiny["eagle"], target, tree=DynamicTree(3, 4, 8), progress=False)
    reference = target.generate(EAGLE_PROMPTS, max_new_tokens=50, eos_token_id=[])
    gen = SpeculativeGenerator(LookupBranch(PromptLookup(target), tree, 3), target,
                               gate=CostGate(probe_every=2, max_probe_every=2))
    kinds = record_kinds(gen)
    assert torch.equal(gen.generate(EAGLE_PROMPTS, max_new_tokens=50, eos_token_id=[]), reference)
    assert kinds.count(True) >= 3 and kinds.count(False) >= 3


# ---------------------------------------------------------------- lossless sampling

@pytest.mark.parametrize("kind", ["draft", "lookup", "lookup+draft"])
def test_sampling_with_mixed_steps_is_lossless(lossless_models, kind):
    """lookup+draft: the model's drafts at misses gated too (both kinds at misses, every call)."""
    target_hf, target, drafts = lossless_models
    gen = SpeculativeGenerator(proposer(kind, target, drafts["full"]), target, 2,
                               gate=CostGate(probe_every=2, max_probe_every=2))
    kinds = record_kinds(gen)
    misses = record_kinds(gen, gen.proposer.draft_meter) if kind == "lookup+draft" else None
    pvalue = lossless_pvalue(target_hf, target, gen, dict(temperature=0.7), 4)      # 20,480 samples of 4 tokens
    assert kinds.count(True) >= 40 and kinds.count(False) >= 40                   # both kinds in every call
    assert misses is None or (misses.count(True) >= 20 and misses.count(False) >= 20)
    assert pvalue > 1e-3


# ---------------------------------------------------------------- CLI and bench-spec

def test_bench_spec_and_cli_gate(checkpoint, monkeypatch):
    import specdec
    from specdec import DraftModel
    from specdec.options import ModelOptions, OptionError, SpeculationOptions
    from specdec.tools.bench import speculative as bench

    target = load(checkpoint("llama"), batch_size=1)
    draft = DraftModel(load(checkpoint("llama-draft"), batch_size=1))
    monkeypatch.setattr(specdec, "shipped", lambda kind, target: draft)
    systems, _ = bench.speculative_systems(bench.parse_options(["--strategy", "lookup,model", "--gate", "on",
                                                                "--ks", "3"]), target)
    assert list(systems) == ["specdec-lookup-k3-gate", "specdec-model-k3-gate"]
    assert all(s.make().gate_meter.gate == CostGate() for s in systems.values())
    systems, _ = bench.speculative_systems(bench.parse_options(["--strategy", "lookup", "--gate", "both",
                                                                "--ks", "3"]), target)
    assert list(systems) == ["specdec-lookup-k3", "specdec-lookup-k3-gate"]
    assert systems["specdec-lookup-k3"].make().gate_meter is None
    with pytest.raises(ValueError, match="--gate runs unfused"):
        bench.speculative_systems(bench.parse_options(["--strategy", "model", "--gate", "on", "--fused", "on"]),
                                  target)
    for given in (dict(draft="none"), dict(draft="model", fused=True)):
        with pytest.raises(OptionError, match="--gate needs a --draft"):
            SpeculationOptions(gate=True, **given).checked(ModelOptions())


def test_eagle_rereads_the_pairs_of_plain_steps_before_drafting(tiny):
    """After plain steps the EAGLE draft re-reads the true pairs it missed before drafting: at every
    re-read, every slot before the row's last position has been written from a true pair (by the
    prompt's context encoding or a re-read window). Without the catch-up, the slots of the tokens that
    plain steps emitted would hold zeros or tree scratch."""
    from specdec import DynamicTree, EagleTreeDraft

    from test_eagle import PROMPTS as EAGLE_PROMPTS
    from test_eagle import load_target
    target = load_target(tiny["target_dir"])
    draft = EagleTreeDraft.from_pretrained(tiny["eagle"], target, tree=DynamicTree(3, 4, 8), progress=False)
    gen = SpeculativeGenerator(draft, target, gate=CostGate(probe_every=4, max_probe_every=4))
    kinds = record_kinds(gen)
    written = [set(range(len(p))) for p in EAGLE_PROMPTS]
    read, reread, checked = draft._read, draft.reread, []

    def logged(first, W, *args):
        for r, f in enumerate(first.tolist()[:len(written)]):
            written[r].update(range(f, f + W))
        return read(first, W, *args)

    def checked_reread(n, *args, **kwargs):
        out = reread(n, *args, **kwargs)
        for r, length in enumerate(n.tolist()[:len(written)]):
            assert set(range(length - 1)) <= written[r], f"row {r}: slots before {length - 1} never written"
            checked.append(length)
        return out
    draft._read, draft.reread = logged, checked_reread
    reference = target.generate(EAGLE_PROMPTS, max_new_tokens=50, eos_token_id=[])
    assert torch.equal(gen.generate(EAGLE_PROMPTS, max_new_tokens=50, eos_token_id=[]), reference)
    assert kinds.count(False) >= 5 and len(checked) >= 3 * 5
