"""The verification rule (Leviathan et al. 2023, Algorithm 1), batched.

Notation of the paper: p = target distribution, q = draft distribution, K = number
of drafted tokens. For sequence b the drafter proposed x_1..x_K (x_i ~ q_i); the
target scored them in one pass, giving p_1..p_{K+1} (p_i judges x_i; p_{K+1} is
the distribution after the last draft). Left to right:

    accept x_i  iff  u_i * q_i(x_i) < p_i(x_i)        (i.e. u_i < p/q, u_i ~ U[0,1))
    first rejection at i = n+1: emit y ~ max(0, p_{n+1} - q_{n+1})   (the residual)
    all K accepted (n = K):     emit y ~ p_{K+1}                     (the bonus token)

Each sequence emits x_1..x_n, y: between 1 and K+1 tokens, distributed exactly as p.

Labelled deviations from the textbook form, none of which changes the law:
- `u * q < p` instead of `u <= p / q`: no division, so q(x) = 0 cannot make NaN.
  A drafted token with q(x) = 0 is rejected outright (it cannot have been drawn
  from q; the input is inconsistent and rejecting is the safe reading).
- strict `<` with u in [0, 1): P(u < r) = r exactly (up to float64 resolution: the
  test runs in float64 whatever p's dtype, u is a float64 uniform), and p(x) = 0 is
  never accepted even when u == 0.
- the residual is sampled unnormalised, by inverse CDF with one uniform v per sequence
  (`probs.sample_with_uniform`, float64); if it is all zero (p == q up to rounding, where
  rejection has probability 0 in exact arithmetic) we sample from p instead of dividing by zero.
- a deterministic drafter (n-gram lookup, greedy) passes `q=None`: q is one-hot at
  the drafted token without materialising a V-sized row; then q(x) = 1 and the
  residual is p with x zeroed.

Greedy decoding is not a separate path: with temperature 0 both p and q are
one-hot, so "accept iff x == argmax p" and "emit argmax p" fall out of these lines.

Every row is handled on its own: nothing is normalised or reduced across the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.core.probs import sample_with_uniform
from specdecode.core.tree import verify_tree


@dataclass(frozen=True, slots=True)
class Randomness:
    """All the randomness one verification consumes, drawn up front.

    u: [B, K]  uniforms in [0, 1) for the accept tests
    v: [B]     a uniform in [0, 1) for the one residual/bonus sample per sequence (inverse CDF)

    One uniform, not V-sized noise: the last sample reads a float64 cumulative sum of the
    residual at v (0.15 ms for Qwen's 151,936 tokens, where an exponential race over V draws
    cost about 3 ms a round).
    """

    u: torch.Tensor
    v: torch.Tensor

    @staticmethod
    def draw(batch: int, k: int, generator: torch.Generator | None,
             device: torch.device | str = "cpu") -> "Randomness":
        """Drawn where the generator lives (a CPU generator: the CPU), then moved to `device`
        (p's): a seed gives the same randomness whatever device the models run on."""
        where = generator.device if generator is not None else torch.device("cpu")
        uv = torch.rand((batch, k + 1), generator=generator, dtype=torch.float64, device=where).to(device)
        return Randomness(u=uv[:, :k], v=uv[:, k])


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """n_accepted [B]; tokens [B, K+1]: the n accepted drafts then the residual/bonus
    token, padded with -1. Sequence b emits tokens[b, : n_accepted[b] + 1]."""

    n_accepted: torch.Tensor
    tokens: torch.Tensor

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.n_accepted + 1

    def emitted(self, b: int) -> list[int]:
        return self.tokens[b, : int(self.n_accepted[b]) + 1].tolist()

    @staticmethod
    def of(draft_tokens: torch.Tensor, n_accepted: torch.Tensor, y: torch.Tensor) -> "VerifyResult":
        """Row b keeps its first n_accepted[b] drafts, then y[b]; the rest is -1."""
        B, K = draft_tokens.shape
        tokens = torch.full((B, K + 1), -1, dtype=torch.long, device=draft_tokens.device)
        kept = torch.arange(K, device=draft_tokens.device) < n_accepted.unsqueeze(-1)
        tokens[:, :K] = torch.where(kept, draft_tokens, tokens[:, :K])
        tokens[torch.arange(B, device=draft_tokens.device), n_accepted] = y
        return VerifyResult(n_accepted=n_accepted, tokens=tokens)


def verify(draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
           rand: Randomness, lengths: torch.Tensor | None = None) -> VerifyResult:
    """Speculative verification for a batch.

    draft_tokens [B, K]; q [B, K, V] or None (deterministic drafter, one-hot q);
    p [B, K+1, V]; lengths [B] (optional, ragged K: only the first lengths[b]
    drafts of row b are real, p[b, lengths[b]] is its bonus distribution).
    """
    lengths = check_inputs(draft_tokens, q, p, rand, lengths)
    B, K = draft_tokens.shape
    rows = torch.arange(B, device=p.device)

    p_x = p[:, :K].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # p_i(x_i)
    q_x = torch.ones_like(p_x) if q is None else q.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    real = torch.arange(K, device=p.device) < lengths.unsqueeze(-1)
    # the accept test in float64 whatever p's dtype (float32 -> float64 is exact): rounding u to
    # float32 would move P(u < r) off r by up to 2^-24 (e.g. u just below r rounds up to r)
    accept = real & (q_x > 0) & (rand.u.to(torch.float64) * q_x.to(torch.float64) < p_x.to(torch.float64))
    n = accept.long().cumprod(dim=-1).sum(dim=-1)  # drafts accepted before the first rejection

    p_next = p[rows, n]  # p_{n+1}: residual row if rejected, bonus row if n == lengths
    rejected = n < lengths
    if q is None:  # max(0, p - one-hot x) is p with x's entry zeroed (p(x) <= 1), without a V-sized q row
        residual = p_next.clone()
        residual[rows, draft_tokens[rows, n.clamp(max=K - 1)]] = 0.0
    else:
        residual = (p_next - q[rows, n.clamp(max=K - 1)]).clamp_min(0)
    residual = torch.where(rejected.unsqueeze(-1), residual, p_next)
    residual = torch.where((residual.sum(-1) > 0).unsqueeze(-1), residual, p_next)
    y = sample_with_uniform(residual, rand.v)
    return VerifyResult.of(draft_tokens, n, y)


# the rule a tree round of this chain rule takes (a verification rule names its tree version; the
# audit's broken controls name broken ones)
verify.tree_rule = verify_tree  # type: ignore[attr-defined]


def verify_reference(draft_tokens: list[int], q: torch.Tensor | None, p: torch.Tensor,
                     u: torch.Tensor, v: torch.Tensor) -> list[int]:
    """One sequence, one token at a time: the oracle the batched `verify` must match
    bit for bit. q [K, V] or None (one-hot), p [K+1, V], u [K], v [] (the last sample's uniform).
    Returns the emitted tokens (accepted drafts + residual/bonus token)."""
    emitted: list[int] = []
    for i, x in enumerate(draft_tokens):
        q_i = torch.zeros_like(p[i]).index_fill_(0, torch.tensor([x], device=p.device), 1.0) if q is None else q[i]
        if q_i[x] > 0 and u[i].to(torch.float64) * q_i[x].to(torch.float64) < p[i, x].to(torch.float64):
            emitted.append(x)
            continue
        residual = (p[i] - q_i).clamp_min(0)
        if residual.sum() <= 0:
            residual = p[i]
        return emitted + [int(sample_with_uniform(residual, v))]
    return emitted + [int(sample_with_uniform(p[len(draft_tokens)], v))]


def check_inputs(draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                 rand: Randomness, lengths: torch.Tensor | None, atol: float = 1e-3) -> torch.Tensor:
    """Validate shapes and distributions; return lengths ([B], K everywhere if None)."""
    if draft_tokens.dim() != 2 or draft_tokens.dtype != torch.long:
        raise ValueError(f"draft_tokens must be an int64 tensor [B, K], got {tuple(draft_tokens.shape)} "
                         f"{draft_tokens.dtype}")
    B, K = draft_tokens.shape
    if K < 1:
        raise ValueError("K must be >= 1: verify at least one draft token (with nothing drafted, sample from p)")
    if p.dim() != 3 or p.shape[0] != B or p.shape[1] != K + 1:
        raise ValueError(f"p must be [B, K+1, V] = [{B}, {K + 1}, V] for draft_tokens [{B}, {K}], "
                         f"got {tuple(p.shape)}")
    V = p.shape[2]
    if q is not None and tuple(q.shape) != (B, K, V):
        raise ValueError(f"q must be [B, K, V] = [{B}, {K}, {V}] (or None for a deterministic drafter), "
                         f"got {tuple(q.shape)}")
    if tuple(rand.u.shape) != (B, K):
        raise ValueError(f"randomness u must be [B, K] = [{B}, {K}], got {tuple(rand.u.shape)}")
    if tuple(rand.v.shape) != (B,):
        raise ValueError(f"randomness v must be [B] = [{B}], got {tuple(rand.v.shape)}")
    if lengths is None:
        lengths = torch.full((B,), K, dtype=torch.long, device=p.device)
    elif tuple(lengths.shape) != (B,) or bool(((lengths < 1) | (lengths > K)).any()):
        raise ValueError(f"lengths must be [B] with 1 <= lengths <= K={K}, got {lengths.tolist()}")
    if bool(((draft_tokens < 0) | (draft_tokens >= V)).any()):
        raise ValueError(f"draft_tokens must be token ids in [0, {V})")
    _check_distribution("p", p, torch.arange(K + 1, device=p.device) <= lengths.unsqueeze(-1), atol)
    if q is not None:
        _check_distribution("q", q, torch.arange(K, device=p.device) < lengths.unsqueeze(-1), atol)
    return lengths


def _check_distribution(name: str, probs: torch.Tensor, valid_rows: torch.Tensor, atol: float) -> None:
    # two reductions over the V-sized rows and nothing copied: a NaN anywhere makes its row's sum NaN
    # (selecting the valid rows first copied them, and the checks took 1.3 of a round's 1.5 ms on 151,936 tokens)
    sums, lowest = probs.sum(-1)[valid_rows], probs.amin(-1)[valid_rows]
    if torch.isnan(sums).any() or (lowest < 0).any():
        raise ValueError(f"{name} contains NaN or negative entries; pass probabilities, not logits")
    if ((sums - 1).abs() > atol).any():
        worst = float(sums[(sums - 1).abs().argmax()])
        raise ValueError(f"{name} rows must sum to 1 (found a row summing to {worst:.6f}); "
                         f"pass probabilities from logits_to_probs, not logits")
