"""Block verification (Sun et al., ICLR 2025, Algorithm 2), batched: the chain judged as a whole.

Same inputs and notation as `verify` (x_1..x_K drafted from q_1..q_K, p_1..p_{K+1} from
the target). Token-by-token verification stops at the first rejection; block verification
carries a running acceptance weight through the whole draft and keeps the longest prefix
it may, which is never shorter in expectation (the paper proves it optimal for a chain):

    P_0 = 1,   P_i = min(1, P_{i-1} * p_i(x_i) / q_i(x_i))                 (x_1..x_i's weight)
    r_i(.) = max(0, P_i * p_{i+1}(.) - q_{i+1}(.))                           (residual after i)
    h_i = |r_i| / (|r_i| + 1 - P_i)  for i < K,    h_K = P_K                (stop-here probability)
    tau = the largest i in 1..K with u_i < h_i  (0 if none)
    emit x_1..x_tau, then y ~ p_{K+1} if tau = K, else y ~ r_tau / |r_tau|   (r_0 = max(0, p_1 - q_1))

Unlike the token rule, a test that fails does not end the round: a later position can
still pass and keep everything before it. Each sequence emits 1..K+1 tokens distributed
exactly as p (tests/core/test_block.py checks the law by enumeration).

Labelled deviations, none of which changes the law:
- q_i(x_i) = 0 (x_i cannot have been drawn from q) makes P_i = 0 from there on: its
  prefix is never kept, as the token rule rejects it.
- h_i = 0 when |r_i| + 1 - P_i = 0 (then P_i = 1 and p_{i+1} <= q_{i+1}: the next position
  accepts whatever q drafts, so stopping here is never needed).
- an all-zero residual (rounding) falls back to p_{tau+1}, as in `verify`.
- `u < h` with u a float64 uniform in [0, 1): P(u < h) = h, and the weights run in float64.
- deterministic drafts (q=None) are one-hot q without V-sized rows: then
  |r_i| = P_i * (1 - p_{i+1}(x_{i+1})) and r_i is P_i * p_{i+1} with x_{i+1} zeroed.
"""

from __future__ import annotations

import torch

from specdecode.core.probs import sample_with_uniform
from specdecode.core.tree import verify_tree
from specdecode.core.verify import Randomness, VerifyResult, check_inputs


def verify_block(draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                 rand: Randomness, lengths: torch.Tensor | None = None) -> VerifyResult:
    """Block verification for a batch; the signature and result are `verify`'s."""
    lengths = check_inputs(draft_tokens, q, p, rand, lengths)
    B, K = draft_tokens.shape
    rows = torch.arange(B, device=p.device)
    # float64 only where needed: with one-hot q (lookup) the V-sized rows are touched once, for y
    q64 = None if q is None else q.to(torch.float64)

    # P_i for i = 0..K: the running weight (float64; a zero q_i(x_i) zeroes it for good)
    p_x = p[:, :K].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1).to(torch.float64)
    q_x = torch.ones_like(p_x) if q64 is None else q64.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    ratio = torch.where(q_x > 0, p_x / torch.where(q_x > 0, q_x, 1.0), 0.0)
    weight = torch.ones((B, K + 1), dtype=torch.float64, device=p.device)
    for i in range(1, K + 1):
        weight[:, i] = (weight[:, i - 1] * ratio[:, i - 1]).clamp(max=1.0)

    # |r_i| for i = 0..K-1 (the residual at position i+1 after keeping i drafts)
    if q64 is None:
        mass = weight[:, :K] * (1 - p_x)  # one-hot q_{i+1} at x_{i+1}: p_x[:, i] is p_{i+1}(x_{i+1})
    else:
        mass = (weight[:, :K, None] * p[:, :K].to(torch.float64) - q64).clamp_min(0).sum(-1)  # |max(0, P_i p_{i+1} - q_{i+1})|
    denominator = mass + 1 - weight[:, :K]
    h_residual = torch.where(denominator > 0, mass / torch.where(denominator > 0, denominator, 1.0), 0.0)
    h = torch.cat([h_residual[:, 1:], weight[:, K:]], dim=1)  # h_1..h_K (h_0 is never tested)
    h[rows, lengths - 1] = weight[rows, lengths]  # h_len = P_len at each row's last real draft

    real = torch.arange(K, device=p.device) < lengths.unsqueeze(-1)
    stop = real & (rand.u.to(torch.float64) < h)
    positions = torch.arange(1, K + 1, device=p.device)
    tau = torch.where(stop, positions, 0).amax(dim=-1)  # the largest i with u_i < h_i, or 0

    bonus = tau == lengths
    p_next = p[rows, tau].to(torch.float64)
    w = weight[rows, tau].unsqueeze(-1)
    if q64 is None:
        residual = w * p_next
        residual[rows, draft_tokens[rows, tau.clamp(max=K - 1)]] = 0.0
    else:
        residual = (w * p_next - q64[rows, tau.clamp(max=K - 1)]).clamp_min(0)
    residual = torch.where(bonus.unsqueeze(-1), p_next, residual)
    residual = torch.where((residual.sum(-1) > 0).unsqueeze(-1), residual, p_next)
    y = sample_with_uniform(residual, rand.v)
    return VerifyResult.of(draft_tokens, tau, y)


# a chain rule: a tree round takes the multi-candidate walk (core/tree.py), as under `verify`
verify_block.tree_rule = verify_tree  # type: ignore[attr-defined]


def verify_block_reference(draft_tokens: list[int], q: torch.Tensor | None, p: torch.Tensor,
                           u: torch.Tensor, v: torch.Tensor) -> list[int]:
    """One sequence, written as the paper's loop: the oracle `verify_block` must match bit for bit.
    q [K, V] or None (one-hot), p [K+1, V], u [K], v [] (the last sample's uniform)."""
    K = len(draft_tokens)
    p = p.to(torch.float64)

    def q_row(i: int) -> torch.Tensor:  # q_{i+1} as a dense row
        if q is not None:
            return q[i].to(torch.float64)
        return torch.zeros_like(p[i]).index_fill_(0, torch.tensor([draft_tokens[i]], device=p.device), 1.0)

    weight, weights, tau = 1.0, [1.0], 0
    for i in range(1, K + 1):
        x, q_i = draft_tokens[i - 1], q_row(i - 1)
        weight = min(1.0, weight * float(p[i - 1, x]) / float(q_i[x])) if q_i[x] > 0 else 0.0
        weights.append(weight)
        if i == K:
            h = weight
        else:
            mass = float((weight * p[i] - q_row(i)).clamp_min(0).sum())
            h = mass / (mass + 1 - weight) if mass + 1 - weight > 0 else 0.0
        if float(u[i - 1]) < h:
            tau = i
    if tau == K:
        residual = p[K]
    else:
        residual = (weights[tau] * p[tau] - q_row(tau)).clamp_min(0)
        if residual.sum() <= 0:
            residual = p[tau]
    return list(draft_tokens[:tau]) + [int(sample_with_uniform(residual, v))]
