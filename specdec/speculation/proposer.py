"""The proposer protocol: what speculation needs from any draft strategy.

A proposer only proposes; a verifier (``specdec.speculation.verify``) runs the target over the proposal and
applies the shared acceptance rules. The speculation step (``specdec.speculation.speculative.Speculator``) calls:

    start(rows, prompts, params, rng, target_out)   after the target's context encoding of ``rows``
    propose(tail, lengths, k, params, rng)          every step with k > 0 → Proposal
    accepted(lengths, verified)                     every step, after acceptance
    max_draft_tokens(length)                        the largest k a row of ``length`` tokens allows
    finished(rows, lengths)                         when requests end (an optional ability, see below)

Per row r, S_r = prompt + emitted tokens. ``tail`` [B, 2] holds the last two tokens of S_r and
``lengths`` [B] = len(S_r); S_r[-1] is not in the target's KV cache yet. ``rows`` names the batch rows
that (re)start (None: rows 0 .. len(prompts)-1 and every row restarts); a proposer keeps per-row state
and must leave the other rows' state alone. ``target_out`` (a ``StepOutput``) holds, in ``prompts``
order, the token sampled after each prompt and the hidden state of every prompt position. ``rng`` is
the per-row ``RowGenerators`` every random draw must come from. ``verified`` (``Verified``) holds the
accepted count, the emitted tokens and the target's verify outputs, which EAGLE / Medusa read.

A proposal is a chain or a tree (``Proposal``).

Optional abilities are DECLARED, never discovered: ``BaseProposer`` gives every one a default (a plain
chain proposer that has none of them) and a proposer class lists the ones it has in ``abilities``
(``ABILITIES`` says what each means). Speculation reads the attributes directly; a feature that needs an
ability a proposer lacks raises ``MissingAbility``, which names it. ``declared`` checks a proposer once,
when speculation is set up: an object that implements only the four methods (not a ``BaseProposer``) is
wrapped as ``PlainProposer`` (no optional abilities); one that carries an ability's attribute without
declaring it is refused by name, so nothing it has is silently ignored.
Invariants (``tests/test_registry.py`` checks them for every proposer class): "depth" declared ⇔
``depth`` is an int, and likewise ``verifier`` / ``verify_size`` / ``model`` / ``draft`` / ``fused_drafter`` /
``cache`` not None; a method ability (``check_target``, ``reread_width``, ``finished``, ``gate_drafts``; "deferred":
``flush``) is declared ⇔ the class overrides ``BaseProposer``'s default; "pending" is declared only with
"depth" (a dynamic tree proposer), "padded" only without it (chains), "fused_drafter" only with "model" (the
fused graph sizes the draft's cache from it).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from ..core.sampling import RowGenerators
from ..core.target import StepOutput
from .gate import CostGate, GateMeter
from .tree import RowTrees


@dataclass
class Proposal:
    """Draft tokens for every row: a chain or a tree.

    tokens [B, N] long: a chain's drafts x_1 .. x_k (N = k), or a tree's N non-root nodes in node order
    (``specdec.speculation.tree``; the root is S[-1]).
    probs [B, N, V] f32 or None: the distribution each token was *sampled* from (lossless rejection
    sampling needs it); None means deterministic proposals (argmax, lookup, top-k trees), for which the
    one-hot rule is used.
    tree: None for a chain, else the per-row trees (``specdec.speculation.tree.RowTrees``: mask [B, N+1, N+1],
    depth, parent [B, N+1], ancestors [B, N+1, D+1], child_nodes [B, N+1, C]); rows may differ.
    num_drafts [B] long or None (chains only): how many of the k drafts each row really proposes; the
    verifier ignores the rest (``acceptance.accept``'s ``num_drafts``). None: k for every row. A proposer
    declaring "padded" sets it (its rows' real drafts, a function of S only, then padding); the
    speculation step caps it when k adapts per row (``specdec.speculation.adaptive``) and verifies only
    the longest active row's drafts (``specdec.speculation.speculative.narrowed``; none: a greedy step is a
    decode step, a sampling step verifies one).
    draw_width: None, or (a sampling chain ``narrowed`` cut from k drafts to its longest row's) k: the verifier
    draws the random noise of k drafts, so a row's stream does not depend on its neighbours' drafts.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    tree: RowTrees | None = None
    num_drafts: torch.Tensor | None = None
    draw_width: int | None = None


@dataclass
class Verified:
    """The verifier's result (device tensors): num_accepted [B] long; emitted [B, D+1] long — the
    accepted drafts, then the correction / bonus token, then -1; target_out: the target's verify
    ``StepOutput`` over the N+1 verified positions ([S[-1], drafts...]); last_node [B] long: the index
    into those positions of the last accepted token (chain: num_accepted; tree: the deepest accepted
    node), whose hidden state predicts the next token."""

    num_accepted: torch.Tensor
    emitted: torch.Tensor
    target_out: StepOutput
    last_node: torch.Tensor


@runtime_checkable
class Proposer(Protocol):
    """The four methods (and two sizes) every proposer has; the optional abilities: ``BaseProposer``."""

    vocab_size: int
    batch_size: int

    def start(self, rows: list[int] | None, prompts: list[torch.Tensor], params: torch.Tensor,
              rng: RowGenerators, target_out: StepOutput) -> None: ...

    def propose(self, tail: torch.Tensor, lengths: torch.Tensor, k: int, params: torch.Tensor,
                rng: RowGenerators) -> Proposal: ...

    def accepted(self, lengths: torch.Tensor, verified: Verified) -> None: ...

    def max_draft_tokens(self, length: int) -> int:
        """The largest k a step may ask for when the longest row has ``length`` tokens."""
        ...


def step_k(proposer: Proposer, k: int, n_positions: int, longest: int) -> int:
    """The drafts a step may take when its longest row has ``longest`` tokens: at most ``k``, the target's
    positions left (``n_positions`` - longest) and the proposer's ``max_draft_tokens``; 0: a plain decode step."""
    return max(0, min(k, n_positions - longest, proposer.max_draft_tokens(longest)))


class Verifier(Protocol):
    """Runs the target over a proposal and applies the shared acceptance rules (``specdec.speculation.verify``)."""

    def verify(self, target, proposal: Proposal, tail: torch.Tensor, lengths: torch.Tensor, params: torch.Tensor,
               rng: RowGenerators) -> Verified: ...


REQUIRED = ("start", "propose", "accepted", "max_draft_tokens")
ABILITIES = {
    "depth": "a tree proposer: its tree's depth, which is the generator's k",
    "verifier": "the verifier its proposals are checked with (a tree's TreeVerifier); default ChainVerifier()",
    "verify_size": "tokens one verify step feeds the target (a tree's nodes + the root); default k + 1",
    "check_target": "check_target(target) refuses a target it cannot propose for (device, tokenizer, sizes)",
    "fused_drafter": "fused_drafter(key): its k draft steps as one module inside the fused step's graph, as "
                     "DraftModel and EagleDraft have",
    "reread_width": "reread_width(k): positions its first draft step re-reads (a fused graph's width); default 0",
    "model": "the draft network whose graphs it runs (a DecoderModel / EagleModel)",
    "draft": "a combination's model proposer (the one behind prompt lookup)",
    "pending": "its step's per-row trees, which a wrapper may replace before accepted() (LookupBranch grafts)",
    "finished": "finished(rows, lengths): told when the requests in rows end (EOS, budget, stop, release), "
                "each with its final len(S), so it can learn from them across requests; default: ignored",
    "cache": "the cross-request cache it drafts from (a SuffixCache: stats() for a server's metrics)",
    "resyncs": "a chain proposer whose propose() may be skipped on steps where another proposer's tokens are "
               "verified (MatchOrDraft, when every row takes its source): accepted() records them, and the "
               "next propose() first re-reads what its cache missed",
    "deferred": "flush(params): its start puts work off (a draft model's prompt encoding, so a request that never "
                "speculates never runs it); flush does it now: the speculation step before a step that speculates "
                "(outside the gate's timing), a fused step at start",
    "gate_drafts": "gate_drafts(gate) -> GateMeter: where its text source has no match, a combination measures its "
                   "model's drafts against the source's shorter matches (or plain steps) and drafts with the model "
                   "only while that pays (SpeculativeGenerator's gate=; it returns that meter); default: ignored "
                   "(None)",
    "padded": "its chains end in padding where a row has fewer than k drafts (Proposal.num_drafts says how "
              "many are real): a greedy step verifies only the longest active row's real drafts, and is a "
              "plain decode step when no row has any, so its verify graphs are 2 .. k + 1 tokens wide",
}
"""Every optional ability a proposer may declare, and what it means."""


def refuse_prefix_cache(target, strategy: str) -> None:
    """ValueError for a ``prefix_cache`` target: ``strategy``'s drafts read the target's hidden state at every
    prompt position (or its last), which the prompt encoding of a kept prefix's rest does not return."""
    if target.prefix_cache:
        raise ValueError(f"{strategy} reads the target's hidden states of the whole prompt, which a prefix_cache "
                         "target's prompt encoding (the rest after a kept prefix) does not return: load the target "
                         "with prefix_cache=False")


class BaseProposer:
    """The base of every proposer class: each optional ability with its default (none of them), and the
    ``abilities`` the class declares. Subclasses set ``vocab_size`` / ``batch_size`` and implement the
    four methods of ``Proposer``; for each ability they have, they set the attribute (or define the
    method) and list its name in ``abilities``."""

    abilities: ClassVar[frozenset[str]] = frozenset()
    vocab_size: int
    batch_size: int
    depth: int | None = None
    verifier: Verifier | None = None
    verify_size: int | None = None
    fused_drafter: Callable[[Any], torch.nn.Module] | None = None
    model: Any = None
    draft: BaseProposer | None = None
    pending: RowTrees | None = None
    cache: Any = None

    def check_target(self, target) -> None:
        """Nothing to check (a proposer declaring "check_target" raises ValueError for a target it cannot serve)."""

    def reread_width(self, k: int) -> int:
        """No re-read (a proposer declaring "reread_width" says how many positions its first step re-reads)."""
        return 0

    def flush(self, params: torch.Tensor) -> None:
        """Nothing deferred (a proposer declaring "deferred" does now what its ``start`` put off)."""

    def gate_drafts(self, gate: CostGate) -> GateMeter | None:
        """Nothing to gate (a proposer declaring "gate_drafts" gates its model's drafts with ``gate``, a
        ``specdec.speculation.gate.CostGate``, and returns the ``GateMeter`` that measures them)."""

    def finished(self, rows: Sequence[int], lengths: Sequence[int] | None = None) -> None:
        """Nothing to learn (a proposer declaring "finished" is told that the requests in ``rows`` ended;
        ``lengths``: each one's final len(S), where the engine cut it, None: every token it saw). An
        engine calls it once per request; a proposer must accept repeats and rows it never started."""

    def require(self, ability: str, feature: str, hint: str = "") -> None:
        """MissingAbility (naming ``ability``) unless this proposer declares it; ``feature``: what needs it."""
        if ability not in self.abilities:
            raise MissingAbility(feature, ability, self, hint)


class MissingAbility(ValueError):
    """A feature needs an optional proposer ability that the proposer does not declare; names it."""

    def __init__(self, feature: str, ability: str, proposer: object, hint: str = ""):
        name = type(proposer.inner if isinstance(proposer, PlainProposer) else proposer).__name__
        super().__init__(f"{feature} (the proposer ability {ability!r}: {ABILITIES[ability]}); {name} does not "
                         f"declare it{hint}")
        self.ability = ability


class PlainProposer(BaseProposer):
    """A proposer object that is not a ``BaseProposer`` (it implements ``Proposer``'s methods only), seen
    as a plain chain proposer with no optional ability; ``inner`` is the object."""

    def __init__(self, inner: Proposer):
        self.inner = inner
        self.start, self.propose, self.accepted = inner.start, inner.propose, inner.accepted
        self.max_draft_tokens = inner.max_draft_tokens

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def batch_size(self) -> int:
        return self.inner.batch_size


def declared(proposer: object) -> BaseProposer:
    """``proposer`` with its abilities declared, checked once when speculation is set up: itself if it is
    a ``BaseProposer``, else wrapped as ``PlainProposer``. TypeError naming a missing method of
    ``Proposer``, or an optional ability an object that is not a ``BaseProposer`` carries undeclared."""
    for name in REQUIRED:
        if not callable(getattr(proposer, name, None)):
            raise TypeError(f"draft must be a DecoderModel or a proposer (specdec.speculation.proposer.Proposer: "
                            f"{', '.join(REQUIRED)}); {type(proposer).__name__} has no {name}() "
                            "(wrap a DecoderModel as DraftModel(model))")
    if isinstance(proposer, BaseProposer):
        return proposer
    undeclared = [name for name in ABILITIES if hasattr(proposer, name)]
    if undeclared:
        raise TypeError(f"{type(proposer).__name__} has {', '.join(undeclared)}: optional proposer abilities "
                        "must be declared; subclass specdec.BaseProposer and list them in its abilities")
    return PlainProposer(proposer)
