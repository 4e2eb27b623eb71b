"""``SpeculativeGenerator``: the one interface to every strategy.

    gen = SpeculativeGenerator(draft, target, k)
    out = gen.generate(input_ids, max_new_tokens=128)        # ``sample`` is the same call

``draft`` is any proposer (``DraftModel``, ``EagleDraft``, ``MedusaDraft`` or your own object
implementing ``specdec.speculation.proposer.Proposer``) or a plain ``DecoderModel``, which is wrapped as a
``DraftModel``. ``k``: draft tokens per step for chains; for trees the tree's depth (may be left out);
with ``adaptive=True`` (chains) the most a row drafts, each row's own k following its acceptance
(``specdec.speculation.adaptive``); with ``gate=True`` a step speculates only while speculative steps have been
emitting tokens faster than plain ones (``specdec.speculation.gate``). The output distribution is exactly the
target's; greedy output is token for token the target's.
"""
from __future__ import annotations

import torch

from .core.decoder import DecoderModel
from .core.engine import Engine
from .core.stats import SpecStats
from .draft.proposer import DraftModel
from .fused.speculator import FusedSpeculator
from .speculation.adaptive import AdaptiveK
from .speculation.gate import CostGate, GateMeter
from .speculation.proposer import Proposer, declared
from .speculation.speculative import Speculator

SAME_OBJECT = ("the draft is the target object itself: a draft keeps its own KV cache, so load the draft checkpoint "
               "as a separate DecoderModel (DraftModel.from_pretrained(path, target))")


class SpeculativeGenerator:
    """Speculative decoding of ``target`` with ``draft`` proposing ``k`` tokens per step.

    ``proposer`` is ``draft`` as a declared proposer (``specdec.speculation.proposer.declared``: itself, a
    ``DraftModel`` around a ``DecoderModel``, or a ``PlainProposer`` around an object that implements only the
    protocol).
    ``engine`` (``specdec.core.engine.Engine``) runs the requests: ``generate`` / ``sample`` for a
    batch, or ``engine.add`` / ``engine.step`` / ``engine.release`` for rows joining and leaving a
    running batch. ``stats`` accumulates over calls; ``last_stats`` holds the latest call's numbers.

    ``fused=True`` (chain drafts: ``DraftModel``, ``EagleDraft``): each step is one graph — draft loop,
    verification and acceptance (``specdec.fused``; NxD Inference's ``enable_fused_speculation``) —
    with the same outputs as unfused speculation.

    ``adaptive=True`` or an ``AdaptiveK(min_k, max_k)`` (chain drafts, unfused): each row drafts its own
    k_r <= k, grown by 2 after a step whose drafts were all accepted and shrunk by 1 otherwise (Hugging
    Face's ``num_assistant_tokens_schedule="heuristic"``, per row); lossless (``specdec.speculation.adaptive``).

    ``gate=True`` or a ``CostGate(probe_every, smoothing, max_probe_every, warmup)`` (unfused): each step is
    speculative or plain, whichever kind has been emitting tokens faster (measured wall time, after a
    warm-up of both kinds; the other kind is probed now and then), so speculation that does not pay
    falls back to decoding; lossless (``specdec.speculation.gate``). ``gate_meter`` holds the measurements. A
    combination of a text source and a model (``lookup+X``, ``suffix+X``: ``MatchOrDraft``) also drafts with the
    model, where the source has no match, only while that pays (``MatchOrDraft.gate_drafts``; its measurements:
    ``draft_meter``, None for other proposers). ``reset_gate()`` forgets both.
    """

    def __init__(self, draft: DecoderModel | Proposer, target: DecoderModel, k: int | None = None, *,
                 fused: bool = False, adaptive: bool | AdaptiveK = False, gate: bool | CostGate = False):
        if draft is target:
            raise ValueError(SAME_OBJECT)
        proposer = declared(DraftModel(draft) if isinstance(draft, DecoderModel) else draft)
        if proposer.model is target:
            raise ValueError(SAME_OBJECT)
        depth = proposer.depth      # tree proposers: k is the tree's depth
        if depth is not None:
            if k is not None and k != depth:
                name = type(proposer).__name__.removesuffix("Draft")
                raise ValueError(f"k={k!r} but a {name} step drafts the tree's depth {depth}: leave k out "
                                 f"or pass k={depth} (choose another tree for another depth)")
            k = depth
        elif k is None:
            raise ValueError("k (draft tokens per step) is required for a chain draft")
        policy = _adaptive_policy(adaptive, proposer, depth is not None, fused)
        self.gate_meter = _gate_meter(gate, fused)
        # a combination also gates its model's drafts where its source misses
        self.draft_meter = proposer.gate_drafts(self.gate_meter.gate) if self.gate_meter is not None else None
        self.speculator = FusedSpeculator(proposer, target, k) if fused else \
            Speculator(proposer, target, k, policy, self.gate_meter)
        proposer.check_target(target)
        self.proposer, self.target, self.k = proposer, target, k
        self.engine = Engine(target, self.speculator)

    def reset_gate(self) -> None:
        """Forget what the cost gate (and a combination's draft meter) measured: the next steps warm up again,
        e.g. after untimed warm-up runs or when the machine's load changes. Nothing without a gate."""
        for meter in (self.gate_meter, self.draft_meter):
            if meter is not None:
                meter.reset()

    @property
    def stats(self) -> SpecStats:
        return self.engine.stats

    @property
    def last_stats(self) -> SpecStats:
        return self.engine.last_stats

    def generate(self, input_ids, attention_mask=None, **kwargs) -> torch.Tensor:
        """Generate like ``DecoderModel.generate`` (same arguments and output format; see
        ``Engine.generate``) with speculation."""
        return self.engine.generate(input_ids, attention_mask, **kwargs)

    sample = generate


def _adaptive_policy(adaptive: bool | AdaptiveK, proposer: Proposer, tree: bool, fused: bool) -> AdaptiveK | None:
    """The ``AdaptiveK`` that ``adaptive`` asks for (None: a fixed k), or ValueError where it does not apply."""
    if adaptive is None or adaptive is False:
        return None
    if adaptive is not True and not isinstance(adaptive, AdaptiveK):
        raise ValueError(f"adaptive must be True, False or an AdaptiveK(min_k, max_k), got {adaptive!r}")
    if tree:
        raise ValueError(f"adaptive speculation length is for chain drafts (DraftModel, EagleDraft, PromptLookup, "
                         f"LookupOrDraft); a {type(proposer).__name__} drafts a tree of fixed depth: "
                         "pass adaptive=False")
    if fused:
        raise ValueError("adaptive speculation length runs unfused (a fused step's graph drafts a fixed k): "
                         "pass fused=False or adaptive=False")
    return AdaptiveK() if adaptive is True else adaptive


def _gate_meter(gate: bool | CostGate, fused: bool) -> GateMeter | None:
    """A fresh ``GateMeter`` for the ``CostGate`` that ``gate`` asks for (None: always speculate)."""
    if gate is None or gate is False:
        return None
    if gate is not True and not isinstance(gate, CostGate):
        raise ValueError(f"gate must be True, False or a CostGate(probe_every, smoothing, max_probe_every, warmup), "
                         f"got {gate!r}")
    if fused:
        raise ValueError("gate runs unfused (a fused step's graph always drafts): pass fused=False or gate=False")
    return GateMeter(CostGate() if gate is True else gate)
