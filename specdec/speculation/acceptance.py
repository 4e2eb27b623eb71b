"""Speculative-decoding acceptance rules: one shared, vectorised implementation for all strategies.

Every function here is a pure function of fixed-shape tensors: no host loop per token, no
``.item()``/``.tolist()``/``nonzero()``, no data-dependent shapes, so each one traces with
``torch.export`` (strict) and runs under ``torch.compile(fullgraph=True)`` or inside a Neuron graph.
All randomness comes in as uniform tensors in ``[0, 1)`` drawn by the caller (``draw_uniforms``,
from a seeded ``torch.Generator``), so a seed reproduces the same tokens.

Shapes: ``B`` rows, ``k`` draft tokens per row (static), ``V`` vocabulary.

Inputs
  draft_tokens  [B, k]      proposals x_0 .. x_{k-1} (long)
  draft_probs   [B, k, V]   q_j = the draft distribution x_j was sampled from (sampled proposals)
  target_probs  [B, k+1, V] p_j = the target distribution at verify position j, conditioned on the
                            prompt and x_0 .. x_{j-1}, after the *same* temperature -> top-k -> top-p
                            warping used for normal sampling (``specdec.core.sampling.warp``);
                            p_k is the bonus distribution after all k drafts
  target_tokens [B, k+1]    the target's argmax tokens (greedy rule)
  num_drafts    [B] or None d_b = how many drafts row b really proposed this step (0 <= d_b <= k);
                            None means k for every row. Drafts at positions j >= d_b are ignored
                            (never accepted, whatever their values) and the correction / bonus token
                            comes from position d_b at most: a row with d_b = 0 is a plain decode step
                            that samples from p_0.
  uniform       [B, k]      u_j, one per acceptance test
  residual_uniform [B]      v, one per row for the correction / bonus draw ([B, 1] also accepted)

Outputs (all rules)
  num_accepted  [B] long    n_b = number of accepted drafts, 0 <= n_b <= d_b
  out_tokens    [B, k+1]    out[b, :n_b] = the accepted drafts, out[b, n_b] = the target's
                            correction token at the first rejection (or the bonus token when all d_b
                            drafts were accepted); out[b, n_b+1:] = ``pad_token_id`` (default -1).
                            Each row emits exactly n_b + 1 tokens; ``last_tokens`` gathers
                            out[b, n_b], the token the next step starts from.

The math
  Greedy (temperature 0):
      n = max{ m <= d : x_j == argmax p_j for all j < m }   (longest matching prefix)
      emit x_0..x_{n-1}, then argmax p_n.
    Because accepted drafts equal the target argmax, out = target_tokens on positions <= n. The output
    is token-for-token identical to target-only greedy decoding.

  Rejection sampling with draft probabilities q (Leviathan et al. 2023, Chen et al. 2023):
      accept_j  = u_j * q_j(x_j) < p_j(x_j)       <=>  u_j < min(1, p_j(x_j) / q_j(x_j))
                                                        (u_j in [0,1); no division, q = 0 safe)
      valid_j   = j < d
      n         = #{ j : accept_i & valid_i for all i <= j }   (index of the first rejection, or d)
      if n < d:  r = max(p_n - q_n, 0);  emit y ~ r / sum(r)   (if sum(r) == 0 then p_n == q_n, use p_n)
      if n == d: emit the bonus y ~ p_d
    For each position, P(emit y) = q(y) min(1, p(y)/q(y)) + (1 - sum_z min(p(z), q(z))) r(y)/sum(r)
    = min(p, q)(y) + max(p - q, 0)(y) = p(y): the emitted sequence has exactly the target's
    distribution (lossless), whatever q is.

  Deterministic proposals (argmax drafts, n-gram / prompt lookup, top-k tree paths): q_j is one-hot
    on x_j. Then accept_j = u_j < p_j(x_j), and r = max(p_n - onehot(x_n), 0) = p_n with x_n's
    entry set to 0, i.e. "resample from p without x". Same code path as above with q one-hot
    (q is never materialised). Lossless by the same identity.

  Categorical draws use the inverse CDF with the given uniform v on the unnormalised weights w:
      y = #{ i : cumsum(w)_i <= v * sum(w) }  (clamped to the last index with w > 0)
    which never picks a zero-weight token (also when v == 0).

Greedy rows inside a sampling batch: ``warp`` turns a temperature-0 row into a one-hot p on the
argmax, for which the rejection rule already reduces to the greedy rule; ``accept`` additionally
applies ``accept_greedy`` to the rows flagged in ``greedy_rows`` so they are bit-exact even when the
argmax has ties.
"""
from __future__ import annotations

import torch

from ..core.sampling import inverse_cdf

__all__ = [
    "accept",
    "accept_greedy",
    "accept_one_hot",
    "accept_rejection",
    "accept_tree_greedy",
    "accept_tree_sampled",
    "accept_tree_typical",
    "draw_tree_uniforms",
    "draw_uniforms",
    "last_tokens",
]


def draw_uniforms(batch_size: int, k: int, generator: torch.Generator | None = None,
                  device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
    """Noise for one acceptance step: ``(uniform [B, k], residual_uniform [B])`` in [0, 1).

    One ``torch.rand`` call of shape [B, k+1], so a seeded generator gives reproducible steps.
    Draw it outside the compiled graph and pass it in, as ``specdec.core.sampling`` does. The
    rules compare and draw in at least float32 whatever the probabilities' dtype.
    """
    if device is None and generator is not None:
        device = generator.device
    u = torch.rand((batch_size, k + 1), generator=generator, device=device, dtype=dtype)
    return u[:, :k], u[:, k]


def _valid_mask(draft_tokens: torch.Tensor, num_drafts: torch.Tensor | None) -> torch.Tensor | None:
    """[B, k] bool: position j holds a real draft (j < num_drafts[b]); None when all do."""
    if num_drafts is None:
        return None
    k = draft_tokens.shape[1]
    pos = torch.arange(k, device=draft_tokens.device)
    return pos.unsqueeze(0) < num_drafts.to(draft_tokens.device).view(-1, 1)


def _prefix_length(accepted: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row of ``accepted [B, k]`` → [B] long.

    Position j is in the prefix iff no False occurs at or before j, i.e. the running count of
    rejections is 0 (a cumsum: integer cumprod has no XLA lowering)."""
    rejected_so_far = torch.cumsum((~accepted).to(torch.long), dim=1)
    return (rejected_so_far == 0).sum(dim=1)


def _assemble(prefix_tokens: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor,
              pad_token_id: int) -> torch.Tensor:
    """out [B, k+1]: prefix_tokens[:, :n], next_token at n, pad after."""
    B, k = prefix_tokens.shape
    pos = torch.arange(k + 1, device=prefix_tokens.device).unsqueeze(0)
    n = num_accepted.view(B, 1)
    padded = torch.cat([prefix_tokens, next_token.view(B, 1).to(prefix_tokens.dtype)], dim=1)
    out = torch.where(pos == n, next_token.view(B, 1).to(prefix_tokens.dtype), padded)
    return torch.where(pos <= n, out, torch.full_like(out, pad_token_id))


def _correction_distribution(p_n: torch.Tensor, q_n: torch.Tensor | None, x_n: torch.Tensor,
                             is_bonus: torch.Tensor) -> torch.Tensor:
    """Unnormalised distribution of the token emitted at position n → [B, V].

    Bonus rows (all drafts accepted): p_n. Rejected rows: max(p_n - q_n, 0), with q_n one-hot on x_n
    when ``q_n`` is None (= p_n with x_n removed); rows whose residual is all zero (p_n == q_n) fall
    back to p_n.
    """
    if q_n is None:
        residual = p_n.scatter(-1, x_n.view(-1, 1), 0.0)
    else:
        residual = torch.clamp(p_n - q_n, min=0.0)
    use_p = is_bonus | (residual.sum(-1) <= 0)
    return torch.where(use_p.view(-1, 1), p_n, residual)


def accept_greedy(draft_tokens: torch.Tensor, target_tokens: torch.Tensor,
                  num_drafts: torch.Tensor | None = None, *, pad_token_id: int = -1):
    """Greedy rule: accept the longest prefix where draft == target argmax.

    draft_tokens [B, k], target_tokens [B, k+1] (argmax of the target at each verify position),
    num_drafts [B] or None → (num_accepted [B] long, out_tokens [B, k+1]). See the module docstring:
    n = longest prefix with x_j == t_j and j < num_drafts; out[:, :n+1] = t[:, :n+1] (the accepted
    drafts, then the target's token at the first mismatch or the bonus token); pad after.
    """
    k = draft_tokens.shape[1]
    match = draft_tokens == target_tokens[:, :k]
    valid = _valid_mask(draft_tokens, num_drafts)
    if valid is not None:
        match = match & valid
    n = _prefix_length(match)
    pos = torch.arange(k + 1, device=target_tokens.device).unsqueeze(0)
    out = torch.where(pos <= n.unsqueeze(1), target_tokens, torch.full_like(target_tokens, pad_token_id))
    return n, out


def _accept_sampled(draft_tokens, draft_probs, target_probs, uniform, residual_uniform, num_drafts,
                    pad_token_id):
    """Shared implementation of the rejection rule; ``draft_probs=None`` means q one-hot on the drafts."""
    B, k = draft_tokens.shape
    V = target_probs.shape[-1]
    dt = torch.promote_types(target_probs.dtype, torch.float32)  # compare / draw in >= fp32
    x = draft_tokens.to(torch.long)
    p_x = target_probs[:, :k].gather(-1, x.unsqueeze(-1)).squeeze(-1).to(dt)       # [B, k]
    u = uniform.to(dt)
    if draft_probs is None:
        accepted = u < p_x                                                         # q(x) = 1
    else:
        q_x = draft_probs.gather(-1, x.unsqueeze(-1)).squeeze(-1).to(dt)
        accepted = u * q_x < p_x                                                   # u < min(1, p/q)
    valid = _valid_mask(draft_tokens, num_drafts)
    if valid is not None:
        accepted = accepted & valid
    n = _prefix_length(accepted)                                                   # [B]
    d = torch.full_like(n, k) if num_drafts is None else num_drafts.to(n.device, torch.long).view(B)
    is_bonus = n >= d

    p_n = target_probs.gather(1, n.view(B, 1, 1).expand(B, 1, V)).squeeze(1).to(dt)  # [B, V]
    if k == 0:
        x_n = torch.zeros_like(n)
        q_n = None if draft_probs is None else torch.zeros_like(p_n)
    else:
        n_c = n.clamp(max=k - 1)
        x_n = x.gather(1, n_c.view(B, 1)).squeeze(1)
        q_n = None
        if draft_probs is not None:
            q_n = draft_probs.gather(1, n_c.view(B, 1, 1).expand(B, 1, V)).squeeze(1).to(dt)
    weights = _correction_distribution(p_n, q_n, x_n, is_bonus)
    y = inverse_cdf(weights, residual_uniform.reshape(B).to(weights.dtype))
    return n, _assemble(draft_tokens, n, y, pad_token_id)


def accept_rejection(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     uniform: torch.Tensor, residual_uniform: torch.Tensor,
                     num_drafts: torch.Tensor | None = None, *, pad_token_id: int = -1):
    """Lossless rejection sampling for drafts sampled from ``draft_probs``.

    draft_tokens [B, k], draft_probs [B, k, V], target_probs [B, k+1, V], uniform [B, k],
    residual_uniform [B], num_drafts [B] or None → (num_accepted [B] long, out_tokens [B, k+1]).
    Accept x_j with prob min(1, p_j(x_j)/q_j(x_j)); at the first rejection n emit y ~ norm(max(p_n -
    q_n, 0)) (p_n if that is all zero); if all num_drafts drafts are accepted emit the bonus y ~ p_d.
    """
    return _accept_sampled(draft_tokens, draft_probs, target_probs, uniform, residual_uniform,
                           num_drafts, pad_token_id)


def accept_one_hot(draft_tokens: torch.Tensor, target_probs: torch.Tensor, uniform: torch.Tensor,
                   residual_uniform: torch.Tensor, num_drafts: torch.Tensor | None = None, *,
                   pad_token_id: int = -1):
    """Lossless rule for deterministic proposals (q one-hot on each draft token).

    Accept x_j with prob p_j(x_j); at the first rejection n emit y ~ p_n with x_n removed and
    renormalised; if all drafts are accepted emit the bonus y ~ p_d. This is ``accept_rejection``
    with q = onehot(x), computed without materialising q. Shapes as ``accept_rejection``.
    """
    return _accept_sampled(draft_tokens, None, target_probs, uniform, residual_uniform,
                           num_drafts, pad_token_id)


def last_tokens(out_tokens: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """The last emitted token of each row, out_tokens[b, num_accepted[b]] → [B]."""
    return out_tokens.gather(1, num_accepted.view(-1, 1)).squeeze(1)


def accept(draft_tokens: torch.Tensor, target_probs: torch.Tensor | None = None,
           draft_probs: torch.Tensor | None = None, *, target_tokens: torch.Tensor | None = None,
           greedy_rows: torch.Tensor | bool | None = None, num_drafts: torch.Tensor | None = None,
           uniform: torch.Tensor | None = None, residual_uniform: torch.Tensor | None = None,
           generator: torch.Generator | None = None, pad_token_id: int = -1):
    """Dispatch to the right rule per row → (num_accepted [B], out_tokens [B, k+1]).

    - ``target_probs is None`` or ``greedy_rows is True``: greedy rule on ``target_tokens``
      (default: ``target_probs.argmax(-1)``); no noise is drawn.
    - otherwise rows are sampled: with ``draft_probs`` [B, k, V] by ``accept_rejection``, without it
      by ``accept_one_hot`` (deterministic proposals — pass ``draft_probs`` whenever the drafts were
      *sampled*, or the result is not lossless);
    - ``greedy_rows`` [B] bool (e.g. ``specdec.core.sampling.greedy_rows(params)``): those rows take the greedy result
      (exact target-only greedy decoding), the others the sampled one.
    Noise: ``uniform`` [B, k] and ``residual_uniform`` [B], or drawn here from ``generator`` with
    ``draw_uniforms`` (outside a compiled graph, pass them in instead).
    """
    B, k = draft_tokens.shape
    if target_probs is None or greedy_rows is True:
        if target_tokens is None:
            if target_probs is None:
                raise ValueError("greedy acceptance needs target_tokens or target_probs")
            target_tokens = target_probs.argmax(-1)
        return accept_greedy(draft_tokens, target_tokens, num_drafts, pad_token_id=pad_token_id)
    if target_probs.shape[:2] != (B, k + 1):
        raise ValueError(f"target_probs must be [B, k+1, V] = [{B}, {k + 1}, V], got {tuple(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape != (B, k, target_probs.shape[-1]):
        raise ValueError(f"draft_probs must be [B, k, V] = [{B}, {k}, {target_probs.shape[-1]}], "
                         f"got {tuple(draft_probs.shape)}")
    if uniform is None or residual_uniform is None:
        u, v = draw_uniforms(B, k, generator, device=None if generator is not None else target_probs.device)
        u, v = u.to(target_probs.device), v.to(target_probs.device)
        uniform = u if uniform is None else uniform
        residual_uniform = v if residual_uniform is None else residual_uniform
    if draft_probs is None:
        n, out = accept_one_hot(draft_tokens, target_probs, uniform, residual_uniform, num_drafts,
                                pad_token_id=pad_token_id)
    else:
        n, out = accept_rejection(draft_tokens, draft_probs, target_probs, uniform, residual_uniform,
                                  num_drafts, pad_token_id=pad_token_id)
    if greedy_rows is None or greedy_rows is False:
        return n, out
    if target_tokens is None:
        target_tokens = target_probs.argmax(-1)
    gn, gout = accept_greedy(draft_tokens, target_tokens, num_drafts, pad_token_id=pad_token_id)
    g = torch.as_tensor(greedy_rows, device=n.device).to(torch.bool).view(B)
    return torch.where(g, gn, n), torch.where(g.view(B, 1), gout, out)


# ----------------------------------------------------------------------------- token trees
# Shared by every tree strategy. Tree inputs, N nodes + root in node order (``specdec.speculation.tree``: node
# 0 = root = the last accepted token, already emitted; parents before children; siblings in rank
# order), max depth D, at most C children per node:
#   tree_tokens   [B, N+1]     token of every node (node 0: the root token)
#   target_probs  [B, N+1, V]  p_i = the target distribution of the token AFTER node i (conditioned on
#                              the path root..i), warped as for normal sampling
#   target_tokens [B, N+1]     argmax of p_i (greedy rule)
#   parent [B, N+1], ancestors [B, N+1, D+1], child_nodes [B, N+1, C]: the ``TreeBuffers`` of each
#                              row's tree (``TreeBuffers.per_row``; one tree for all rows may also be
#                              given without the batch dimension). The root's parent is 0;
#                              ``ancestors`` / ``child_nodes`` are padded with -1.
# Outputs, all tree rules: (num_accepted [B] long = accepted depth n, best_node [B] long = the last
# accepted node (0 when none), out_tokens [B, D+1]: the n accepted tokens (root excluded), then the
# correction / bonus token drawn at best_node, then ``pad_token_id``). Each row emits n + 1 tokens
# and the tree path to keep is ancestors[b, best_node, :n+1].


def _per_row(buffer: torch.Tensor, batch_size: int, node_dims: int) -> torch.Tensor:
    """A tree buffer with a leading batch dimension (one tree for all rows is expanded)."""
    return buffer.expand(batch_size, *buffer.shape) if buffer.dim() == node_dims else buffer


def _gather_nodes(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values [B, N+1, ...] at node indices index [B, *S] (>= 0) → [B, *S, ...]."""
    B, S = index.shape[0], index.shape[1:]
    flat = index.reshape(B, -1)
    tail = values.shape[2:]
    picked = values.gather(1, flat.view(B, -1, *([1] * len(tail))).expand(B, flat.shape[1], *tail))
    return picked.view(B, *S, *tail)


def draw_tree_uniforms(batch_size: int, max_depth: int, max_children: int,
                       generator: torch.Generator | None = None, device: torch.device | str | None = None,
                       dtype: torch.dtype = torch.float32):
    """Noise for one ``accept_tree_sampled`` step: ``(uniform [B, D, C], residual_uniform [B])`` in [0, 1).

    One ``torch.rand`` call of shape [B, D*C + 1]; draw it outside the compiled graph.
    """
    if device is None and generator is not None:
        device = generator.device
    u = torch.rand((batch_size, max_depth * max_children + 1), generator=generator, device=device, dtype=dtype)
    return u[:, :-1].reshape(batch_size, max_depth, max_children), u[:, -1]


def _tree_path_ok(node_ok: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """[B, N+1] bool: every node on the path root..i has ``node_ok`` (padding counts as ok)."""
    on_path = _gather_nodes(node_ok, ancestors.clamp(min=0))                        # [B, N+1, D+1]
    return (on_path | (ancestors < 0)).all(dim=-1)


def _tree_path_tokens(tree_tokens: torch.Tensor, ancestors: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """[B, D]: tokens of the nodes at depths 1..D on the path root..best (garbage past its depth)."""
    path = _gather_nodes(ancestors, best.view(-1, 1)).squeeze(1)[:, 1:].clamp(min=0)   # [B, D]
    return tree_tokens.gather(1, path)


def _node_depth(ancestors: torch.Tensor) -> torch.Tensor:
    return (ancestors >= 0).sum(dim=-1) - 1


def accept_tree_greedy(tree_tokens: torch.Tensor, target_tokens: torch.Tensor, parent: torch.Tensor,
                       ancestors: torch.Tensor, *, real: torch.Tensor | None = None, pad_token_id: int = -1):
    """Greedy tree rule: the deepest node whose whole path matches the target argmax.

    Node i (not the root) matches iff tree_tokens[i] == target_tokens[parent[i]]; a node is accepted
    iff every node on its path matches; best_node = the accepted node of largest depth (the longest
    accepted path), ties broken by the lowest node index (= lexicographically lowest ranks: among
    siblings repeating a token, the lowest-rank one unless a higher-rank one leads to a longer accepted
    path). out = the path's tokens, then target_tokens[best_node]. A node that is not ``real`` [B, N+1] bool
    (None: all are; ``tree.row_trees``' padding) never matches.

    Every accepted token equals the target argmax after its prefix, so the emitted tokens are exactly
    what target-only greedy decoding produces (whichever of several equally long matching paths is
    taken, they carry the same tokens). Shapes: see the tree section above → (num_accepted [B],
    best_node [B], out_tokens [B, D+1]).
    """
    B, n1 = tree_tokens.shape
    parent, ancestors = _per_row(parent, B, 1), _per_row(ancestors, B, 2)
    is_root = torch.arange(n1, device=tree_tokens.device) == 0
    match = (tree_tokens == target_tokens.gather(1, parent)) | is_root
    if real is not None:
        match &= real
    ok = _tree_path_ok(match, ancestors)
    depth = _node_depth(ancestors)
    best = torch.argmax(torch.where(ok, depth, -1), dim=-1)        # first maximum = lowest index
    n = depth.gather(1, best.view(-1, 1)).squeeze(1)
    nxt = target_tokens.gather(1, best.view(-1, 1)).squeeze(1)
    return n, best, _assemble(_tree_path_tokens(tree_tokens, ancestors, best), n, nxt, pad_token_id)


def accept_tree_sampled(tree_tokens: torch.Tensor, target_probs: torch.Tensor, child_nodes: torch.Tensor,
                        uniform: torch.Tensor, residual_uniform: torch.Tensor, *, pad_token_id: int = -1):
    """Lossless recursive multi-draft rejection over a tree of deterministic proposals.

    The SpecInfer / EAGLE rule for sibling drafts whose q is one-hot (top-k tree candidates). Walk from
    the root with r = p_root (unnormalised residual):
        for each child c of the current node, in rank order, with token x = tree_tokens[c]:
            accept c with probability r(x) / sum(r)     (test: u[d, j] * sum(r) < r(x));
            on acceptance: move to c, set r = p_c, go one level deeper;
            on rejection: r(x) = 0 (renormalisation is implicit in sum(r)), try the next sibling;
        when no child is accepted (or the node has none, or depth D is reached): emit y ~ r / sum(r)
        (p at the current node if r is all zero, which only rounding can cause) and stop.

    Proof that each emitted token has the target distribution. Fix a node with residual distribution
    r (normalised) and untried children tokens x_1..x_m; let E(y) be the probability that the token
    emitted at this depth (an accepted child's token or the final draw) is y. Induction on m: m = 0
    gives E = r. For m >= 1, x_1 is accepted with probability r(x_1), otherwise the walk continues
    with r' = r without x_1, renormalised, i.e. r'(y) = r(y)[y != x_1] / (1 - r(x_1)), and by induction
    emits y with probability r'(y). So E(y) = r(x_1)[y = x_1] + (1 - r(x_1)) r'(y) = r(y). (r(x_1) = 1
    means x_1 is accepted surely; repeated sibling tokens have r(x) = 0 after their first rejection and
    are never accepted.) Starting from r = p_root the first token is distributed as p_root; given that
    it was an accepted child c, the walk restarts from r = p_c, the target's distribution given that
    token, with fresh uniforms, so the next token is again exact; after the final draw the next step
    restarts from the new last token. By induction the emitted sequence has exactly the target's
    distribution, whatever the tree and the proposals.

    Vectorised: the sibling tries never touch the vocabulary. With p the target distribution at the
    current node (total mass s = sum(p), 1 up to rounding) and its children's tokens x_1..x_C, the
    residual before child j has lost the mass of the distinct tokens among x_1..x_{j-1}, so
        sum(r) before j = s - sum_{i<j, x_i new} p(x_i),   r(x_j) = p(x_j) if x_j is new, else 0,
    and the first j with u[d, j] * sum(r) < r(x_j) is the accepted child (the sequential walk stops at
    it). Only p at the children's tokens ([B, N+1, C]) is gathered; the final draw reads one full row,
    p at the last node with all its children's tokens removed (it tried them all, or has none).

    Fixed shapes: a loop over the D depths (uniform's dim 1), tensor ops over the C =
    child_nodes.shape[-1] sibling slots. uniform [B, D, C] (``draw_tree_uniforms``, D >= 1 the tree's max
    depth), residual_uniform [B]. Other shapes: see the tree section above → (num_accepted [B],
    best_node [B], out_tokens [B, D+1]).
    """
    B, _, V = target_probs.shape
    child_nodes = _per_row(child_nodes, B, 2)                                            # [B, N+1, C]
    D, C = uniform.shape[1], child_nodes.shape[2]
    dt = torch.promote_types(target_probs.dtype, torch.float32)
    u = uniform.to(dt)
    has = child_nodes >= 0
    kid_tokens = tree_tokens.gather(1, child_nodes.clamp(min=0).flatten(1)).view_as(child_nodes)   # [B, N+1, C]
    p_kid = target_probs.gather(2, kid_tokens).to(dt)                                     # p_node(child token)
    earlier = torch.ones(C, C, dtype=torch.bool, device=has.device).tril(-1)              # [j, i]: i < j
    repeat = ((kid_tokens.unsqueeze(-1) == kid_tokens.unsqueeze(-2)) & earlier & has.unsqueeze(-2)).any(-1)
    fresh = has & ~repeat                                                                # first try of a token
    r_kid = torch.where(fresh, p_kid, 0.0)
    mass_before = target_probs.sum(-1, dtype=dt).unsqueeze(-1) - (r_kid.cumsum(-1) - r_kid)    # sum(r) before j
    ok = has & (r_kid > 0)

    node = torch.zeros(B, dtype=torch.long, device=tree_tokens.device)
    walking = torch.ones(B, dtype=torch.bool, device=tree_tokens.device)
    n = torch.zeros_like(node)
    accepted_tokens = []
    for d in range(D):
        here = node.view(B, 1, 1).expand(B, 1, C)
        take = ok.gather(1, here).squeeze(1) & (u[:, d] * mass_before.gather(1, here).squeeze(1)
                                                < r_kid.gather(1, here).squeeze(1))      # [B, C]
        moved = walking & take.any(-1)
        child = child_nodes.gather(1, here).squeeze(1).gather(1, take.long().argmax(-1, keepdim=True)).squeeze(1)
        node = torch.where(moved, child, node)
        accepted_tokens.append(tree_tokens.gather(1, node.view(B, 1)).squeeze(1))
        n = n + moved.to(n.dtype)
        walking = moved
    p_last = target_probs.gather(1, node.view(B, 1, 1).expand(B, 1, V)).squeeze(1).to(dt)     # [B, V]
    last_kids = kid_tokens.gather(1, node.view(B, 1, 1).expand(B, 1, C)).squeeze(1)
    tried = has.gather(1, node.view(B, 1, 1).expand(B, 1, C)).squeeze(1)
    removed = torch.zeros_like(p_last).scatter_add_(1, last_kids, tried.to(dt)) > 0     # repeats add up
    residual = p_last.masked_fill(removed, 0.0)
    weights = torch.where((residual.sum(-1) > 0).view(B, 1), residual, p_last)
    y = inverse_cdf(weights, residual_uniform.reshape(B).to(dt))
    return n, node, _assemble(torch.stack(accepted_tokens, dim=1), n, y, pad_token_id)


def accept_tree_typical(tree_tokens: torch.Tensor, target_probs: torch.Tensor, parent: torch.Tensor,
                        ancestors: torch.Tensor, residual_uniform: torch.Tensor, *, epsilon: float = 0.09,
                        delta: float = 0.3, real: torch.Tensor | None = None, pad_token_id: int = -1):
    """LOSSY Medusa "typical acceptance": NOT lossless, it changes the output distribution.

    Offered for compatibility with FasterDecoding/Medusa (``posterior_threshold`` = epsilon,
    ``posterior_alpha`` = delta). Node i (not the root) with token x is plausible iff
        p_parent(i)(x) > min(epsilon, delta * exp(-H(p_parent(i)))),  H = entropy in nats;
    best_node = the deepest node whose whole path is plausible, ties broken by the largest path
    log-likelihood sum(log p_parent(j)(x_j)), then by the lowest node index; then the next token is
    sampled y ~ p_best_node with ``residual_uniform`` [B]; a node that is not ``real`` (as in
    ``accept_tree_greedy``) is never plausible. Plausible candidates are accepted with
    probability 1 whatever their target probability, so the emitted tokens are NOT distributed as the
    target's (e.g. a candidate with p = 0.3 at the root is emitted every time instead of 30% of the
    time). With one-hot p (temperature 0) it reduces to the greedy rule. Shapes: see the tree section
    above → (num_accepted [B], best_node [B], out_tokens [B, D+1]).
    """
    B, n1, V = target_probs.shape
    parent, ancestors = _per_row(parent, B, 1), _per_row(ancestors, B, 2)
    dt = torch.promote_types(target_probs.dtype, torch.float32)
    p = target_probs.to(dt)
    entropy = torch.special.entr(p).sum(-1)                                         # [B, N+1]
    threshold = torch.clamp(delta * torch.exp(-entropy), max=epsilon).gather(1, parent)
    p_x = _gather_nodes(p, parent).gather(2, tree_tokens.unsqueeze(-1)).squeeze(-1)  # [B, N+1]
    is_root = torch.arange(n1, device=tree_tokens.device) == 0
    plausible = (p_x > threshold) | is_root
    ok = _tree_path_ok(plausible if real is None else plausible & real, ancestors)
    below_root = ancestors[..., 1:]                                                 # [B, N+1, D]
    log_px = _gather_nodes(torch.log(p_x), below_root.clamp(min=0))                 # [B, N+1, D]
    loglik = torch.where(below_root >= 0, log_px, 0.0).sum(-1)
    depth = _node_depth(ancestors)
    key = torch.where(ok, depth, -1)
    deepest = key == key.max(dim=-1, keepdim=True).values
    best = torch.argmax(torch.where(deepest, loglik, float("-inf")), dim=-1)
    n = depth.gather(1, best.view(-1, 1)).squeeze(1)
    p_best = p.gather(1, best.view(B, 1, 1).expand(B, 1, V)).squeeze(1)
    y = inverse_cdf(p_best, residual_uniform.reshape(B).to(dt))
    return n, best, _assemble(_tree_path_tokens(tree_tokens, ancestors, best), n, y, pad_token_id)
