"""A draft model's deferred work (``DraftModel``, the ability "deferred"): ``start`` encodes nothing, so a
request's first token waits for the target alone and steps that do not speculate cost the draft nothing; the first
speculative step encodes the prompt; a draft far behind its sequence (after the gate's plain steps) catches up in
one context encoding (or in k + 1-token steps where the backend compiles per shape); every proposal is the
draft's greedy continuation of the real sequence, and greedy output stays target-only's, also fused."""
import itertools

import pytest
import torch

from specdec import DraftModel, SpeculativeGenerator
from specdec.core.engine import Engine

from conftest import load, prompt_ids
from test_gate import Clock

PROMPT = prompt_ids(13, 3)


def calls(model, name: str) -> list[tuple[tuple, dict]]:
    """Record every call of ``model.name`` (its arguments) in the returned list."""
    seen, method = [], getattr(model, name)

    def recorded(*args, **kwargs):
        seen.append((args, kwargs))
        return method(*args, **kwargs)
    setattr(model, name, recorded)
    return seen


def scripted_gate(gen: SpeculativeGenerator, plain: int) -> None:
    """The gate's first ``plain`` steps are plain decode steps, every later one speculates."""
    script = itertools.chain([False] * plain, itertools.repeat(True))
    gen.gate_meter.speculate = lambda: next(script)


def test_start_encodes_nothing_and_plain_steps_cost_the_draft_nothing(checkpoint):
    target = load(checkpoint("llama"), batch_size=2)
    draft = load(checkpoint("llama-draft"), batch_size=2)
    reference = target.generate([PROMPT], max_new_tokens=20, eos_token_id=[])[0]
    gen = SpeculativeGenerator(DraftModel(draft), target, 4, gate=True)
    scripted_gate(gen, plain=10 ** 6)
    encoded, stepped = calls(draft, "prefill"), calls(draft, "step")
    engine = Engine(target, gen.speculator)
    row = engine.add(PROMPT, max_new_tokens=20, eos_token_id=[])
    assert engine.rows[row].new and not encoded            # the first token, and no draft encoding yet
    while not engine.rows[row].done:
        engine.step()
    assert engine.rows[row].new == reference[len(PROMPT):].tolist()
    assert not encoded and not stepped                     # a request that never speculated never ran the draft


def test_the_first_speculative_step_encodes_each_started_row(checkpoint):
    target = load(checkpoint("llama"), batch_size=2)
    draft = load(checkpoint("llama-draft"), batch_size=2)
    prompts = [PROMPT, prompt_ids(9, 4)]
    reference = target.generate(prompts, max_new_tokens=12, eos_token_id=[])
    gen = SpeculativeGenerator(DraftModel(draft), target, 4)
    encoded = calls(draft, "prefill")
    engine = Engine(target, gen.speculator)
    rows = [engine.add(p, max_new_tokens=12, eos_token_id=[]) for p in prompts]
    assert not encoded
    engine.step()
    assert [(len(args[0][0]), kwargs["rows"]) for args, kwargs in encoded] == [(13, [0]), (9, [1])]
    while not all(engine.rows[r].done for r in rows):
        engine.step()
    assert [engine.rows[r].new for r in rows] == reference[:, -12:].tolist()
    assert len(encoded) == 2                               # once per row


def recorded_run(gen: SpeculativeGenerator, draft, prompt: list[int], n: int):
    """Greedy ``gen.generate([prompt], n)`` recording the width of every ``draft.step`` and every proposal →
    (output, widths, [(len(S) at the step, the row's drafts)])."""
    widths, proposals = [], []
    step, propose = draft.step, gen.speculator.proposer.propose

    def counted(tokens, *args, **kwargs):
        widths.append(tokens.shape[1])
        return step(tokens, *args, **kwargs)

    def recorded(tail, lengths, k, params, rng):
        proposal = propose(tail, lengths, k, params, rng)
        proposals.append((int(lengths[0]), proposal.tokens[0].tolist()))
        return proposal
    draft.step, gen.speculator.proposer.propose = counted, recorded
    return gen.generate([prompt], max_new_tokens=n, eos_token_id=[]), widths, proposals


@pytest.mark.parametrize("shapes_free", [True, False], ids=["context-graph", "token-steps"])
def test_a_draft_far_behind_catches_up(checkpoint, monkeypatch, shapes_free):
    """25 plain steps, then speculation: the draft encodes the prompt, then the 25 tokens it missed (one
    context graph where a new shape costs nothing, else k + 1 = 5 tokens a step); its proposals are then its
    greedy continuations of the real sequence (recomputed from scratch)."""
    target = load(checkpoint("llama"), batch_size=1)
    draft = load(checkpoint("llama-draft"), batch_size=1)
    fresh = load(checkpoint("llama-draft"), batch_size=1, context_buckets=[16, 32, 64, 128])
    monkeypatch.setattr(draft, "_shapes_free", shapes_free)
    reference = target.generate([PROMPT], max_new_tokens=50, eos_token_id=[])
    gen = SpeculativeGenerator(DraftModel(draft), target, 4, gate=True)
    scripted_gate(gen, plain=25)
    extended = calls(draft, "extend")
    out, widths, proposals = recorded_run(gen, draft, PROMPT, 50)
    assert torch.equal(out, reference)
    assert proposals[0][0] == len(PROMPT) + 26              # speculation began after 25 plain steps
    assert [(args[0], args[2]) for args, _ in extended] == ([(0, len(PROMPT))] if shapes_free else [])
    assert max(widths) == (2 if shapes_free else 5)
    assert all(fresh.generate([out[0, :n].tolist()], max_new_tokens=4, eos_token_id=[])[0, n:].tolist() == drafts
               for n, drafts in proposals)


def test_the_gate_leaves_the_prompt_encoding_out_of_its_rates(checkpoint):
    """The draft's prompt encoding runs before the first speculative step, once a request: the gate times the
    step without it (a once-a-request cost in a step's time would make speculation look slow)."""
    target = load(checkpoint("llama"), batch_size=1)
    draft = load(checkpoint("llama-draft"), batch_size=1)
    gen = SpeculativeGenerator(DraftModel(draft), target, 4, gate=True)
    clock, meter, proposer = Clock(), gen.gate_meter, gen.speculator.proposer
    meter.clock = clock
    flush, record, encoded = proposer.flush, meter.record, calls(draft, "prefill")

    def slow_flush(params):
        if bool(proposer.pending.any()):
            clock.charge(100.0)
        flush(params)
    proposer.flush, seconds = slow_flush, []

    def recorded(speculated, tokens, elapsed):
        seconds.append(elapsed)
        record(speculated, tokens, elapsed)
    meter.record = recorded
    out = gen.generate([PROMPT], max_new_tokens=20, eos_token_id=[])
    assert torch.equal(out, target.generate([PROMPT], max_new_tokens=20, eos_token_id=[]))
    assert len(encoded) == 1 and clock.t > 100                  # encoded once, on the clock
    assert seconds and max(seconds) < 100                       # but in no step's time
