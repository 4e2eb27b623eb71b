"""The speculation layer, shared by every strategy: the proposer protocol (``proposer``), the verifiers
(``verify``) and the lossless acceptance rules (``acceptance``), token trees (``tree``), the speculation
step (``speculative``), mixed match-or-draft batches (``combined``), adaptive k (``adaptive``), the cost
gate (``gate``) and where the shipped strategies' weights are found (``assets``). It imports only the
runtime (``specdec.core``); the strategies (``specdec.draft``, ``eagle``, ``medusa``, ``lookup``,
``suffix``) and fused speculation (``specdec.fused``, the same layer) build on it."""
