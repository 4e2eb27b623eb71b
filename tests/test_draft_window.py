"""A draft model's window (``DraftModel(model, window=W)``): a row's draft never encodes more than W tokens at once.
A long prompt is encoded from its last W tokens, and a draft that missed more than W tokens (the gate's plain
steps) restarts at the last W tokens of its sequence; every proposal is then the draft's greedy continuation of
that suffix of the sequence, and greedy output stays target-only's."""
import itertools

import pytest
import torch

from specdec import DraftModel, SpeculativeGenerator
from specdec.lookup import LookupOrDraft, PromptLookup

from conftest import load, prompt_ids
from test_draft_deferred import calls, recorded_run, scripted_gate

PROMPT = prompt_ids(13, 3)


@pytest.mark.parametrize("shapes_free", [True, False], ids=["context-graph", "token-steps"])
def test_a_windowed_draft_restarts_at_the_last_w_tokens(checkpoint, monkeypatch, shapes_free):
    """Window 8, 25 plain steps, then speculation: the draft encodes the prompt's last 8 tokens, then restarts at
    the last 8 tokens of the sequence instead of catching up on the 25 it missed (no extend, no wide step); each
    proposal is a fresh draft's greedy continuation of the sequence from that restart on."""
    target = load(checkpoint("llama"), batch_size=1)
    draft = load(checkpoint("llama-draft"), batch_size=1)
    fresh = load(checkpoint("llama-draft"), batch_size=1, context_buckets=[16, 32, 64, 128])
    monkeypatch.setattr(draft, "_shapes_free", shapes_free)
    reference = target.generate([PROMPT], max_new_tokens=50, eos_token_id=[])
    gen = SpeculativeGenerator(DraftModel(draft, window=8), target, 4, gate=True)
    scripted_gate(gen, plain=25)
    encoded, extended = calls(draft, "prefill"), calls(draft, "extend")
    out, widths, proposals = recorded_run(gen, draft, PROMPT, 50)
    assert torch.equal(out, reference)
    first = len(PROMPT) + 26                                   # the length at the first speculative step
    assert proposals[0][0] == first
    assert [args[0][0].tolist() for args, _ in encoded] == [PROMPT[-8:], out[0, first - 9:first - 1].tolist()]
    assert not extended and max(widths) == 2
    base = first - 9
    assert all(fresh.generate([out[0, base:n].tolist()], max_new_tokens=4, eos_token_id=[])[0, n - base:].tolist()
               == drafts for n, drafts in proposals)


@pytest.mark.parametrize("combined", [False, True], ids=["model", "lookup+model"])
def test_windowed_drafts_keep_the_targets_greedy_output(checkpoint, combined):
    """Batch 2, prompts of 13 and 5 tokens, window 6, runs of plain steps between speculative ones (restarts
    again and again, at different lengths per row): the output is target-only's, alone and under prompt lookup."""
    target = load(checkpoint("llama"), batch_size=2)
    draft = load(checkpoint("llama-draft"), batch_size=2)
    prompts = [PROMPT, prompt_ids(5, 7)]
    reference = target.generate(prompts, max_new_tokens=60, eos_token_id=[])
    proposer = DraftModel(draft, window=6)
    gen = SpeculativeGenerator(LookupOrDraft(PromptLookup(target), proposer) if combined else proposer, target, 3,
                               gate=True)
    script = itertools.cycle([False] * 9 + [True] * 2 + [False] * 3 + [True])
    gen.gate_meter.speculate = lambda: next(script)
    encoded = calls(draft, "prefill")
    assert torch.equal(gen.generate(prompts, max_new_tokens=60, eos_token_id=[]), reference)
    assert max(len(args[0][0]) for args, _ in encoded) == 6
    restarts = [kwargs["rows"] for args, kwargs in encoded if len(args[0][0]) == 6]
    assert restarts.count([0]) > 1 and restarts.count([1]) > 1        # both rows restarted, again and again


def test_window_validation(checkpoint):
    draft = load(checkpoint("llama-draft"), batch_size=1)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="window must be an int >= 1"):
            DraftModel(draft, window=bad)
    assert "fused_drafter" in DraftModel(draft).abilities
    assert "fused_drafter" not in DraftModel(draft, window=8).abilities    # the fused graph reads target positions


def test_rows_that_finish_first_and_the_next_requests(checkpoint):
    """Batch 4, prompts of 9 to 31 tokens, a restarted window in most rows: rows that reach their budget first sit
    out the last steps at the engine's placeholder length (shorter than their window's start), and the next 4
    requests reuse the rows; both calls give target-only's output."""
    target = load(checkpoint("llama"), batch_size=4)
    draft = load(checkpoint("llama-draft"), batch_size=4)
    gen = SpeculativeGenerator(LookupOrDraft(PromptLookup(target), DraftModel(draft, p_min=0.5, window=8)), target, 4)
    for group in ([prompt_ids(20, 1), prompt_ids(30, 2), prompt_ids(9, 3), prompt_ids(14, 4)],
                  [prompt_ids(25, 5), prompt_ids(12, 6), prompt_ids(31, 7), prompt_ids(17, 8)]):
        reference = target.generate(group, max_new_tokens=30, eos_token_id=[])
        assert torch.equal(gen.generate(group, max_new_tokens=30, eos_token_id=[]), reference)


def test_rows_joining_a_running_batch(checkpoint):
    """The serving pattern: a request joins while another runs (its prompt encoded from its last 6 tokens while
    the other row's draft restarts after plain steps), another takes a finished row's place; each request's
    output is target-only's."""
    target = load(checkpoint("llama"), batch_size=2)
    draft = load(checkpoint("llama-draft"), batch_size=2)
    prompts = [PROMPT, prompt_ids(11, 5), prompt_ids(8, 9)]
    budgets = [40, 12, 20]
    references = [target.generate([p], max_new_tokens=n, eos_token_id=[])[0, len(p):].tolist()
                  for p, n in zip(prompts, budgets)]
    gen = SpeculativeGenerator(DraftModel(draft, window=6), target, 3, gate=True)
    script = itertools.cycle([False] * 7 + [True] * 3)
    gen.gate_meter.speculate = lambda: next(script)
    engine = gen.engine
    rows = {0: engine.add(prompts[0], max_new_tokens=budgets[0], eos_token_id=[])}
    for _ in range(9):
        engine.step()
    rows[1] = engine.add(prompts[1], max_new_tokens=budgets[1], eos_token_id=[])
    while not engine.rows[rows[1]].done:
        engine.step()
    outputs = {1: list(engine.rows[rows[1]].new)}
    engine.release(rows[1])
    rows[2] = engine.add(prompts[2], max_new_tokens=budgets[2], eos_token_id=[])
    while not (engine.rows[rows[0]].done and engine.rows[rows[2]].done):
        engine.step()
    outputs |= {i: list(engine.rows[rows[i]].new) for i in (0, 2)}
    assert [outputs[i] for i in range(3)] == references
