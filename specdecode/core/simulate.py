"""Monte Carlo rounds of speculative sampling (the documents' exercise 6).

A context-free world: every position has the same target p and draft q. Each
round drafts K tokens from q and runs the real batched `verify` on them, so the
simulator checks the production rule, not a re-implementation. Because the
context does not matter here, every emitted token is an independent draw from p,
and N (tokens per round) follows P(N=i) = alpha^(i-1)(1-alpha), P(N=K+1) = alpha^K.

Memory stays bounded at any vocabulary and K: drafts are drawn from q's one cumulative
sum (not from B x K copies of q), and a batch holds at most BATCH_ELEMENTS of the
B x (K+1) x V entries that `verify` reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.checks import integer
from specdecode.core.probs import inverse_cdf
from specdecode.core.theory import acceptance_rate, expected_tokens, tokens_per_round_pmf
from specdecode.core.verify import Randomness, verify


# entries of the [B, K+1, V] target rows one batch verifies: its [B, V] float64 temporaries (residual,
# cumulative sums) then stay under 2**24 / (K+1) * 8 bytes = 64 MB each, at any V and K (a fixed 4096
# rounds a batch, drafted by `sample` from q expanded to [B, K, V], allocated 26 GB at V = 100,000, K = 8)
BATCH_ELEMENTS = 2**24


@dataclass(frozen=True, slots=True)
class SimulationResult:
    k: int
    rounds: int
    alpha: float  # sum min(p, q), exact
    expected_tokens: float  # E[N] from the formula
    mean_tokens: float  # measured tokens per round
    n_counts: tuple[int, ...]  # n_counts[i-1] = rounds that emitted i tokens, i = 1..K+1
    n_pmf: tuple[float, ...]  # the formula's P(N = i)
    token_counts: tuple[int, ...]  # histogram of every emitted token
    p: tuple[float, ...]  # the target distribution the histogram should follow


def simulate_rounds(p: torch.Tensor, q: torch.Tensor, k: int, rounds: int,
                    generator: torch.Generator, batch: int = 4096) -> SimulationResult:
    """Simulate `rounds` independent rounds with K drafts from q, verified against p.

    `batch` is the most rounds verified at once; fewer where K x V is large (BATCH_ELEMENTS).
    """
    if p.dim() != 1 or p.shape != q.shape:
        raise ValueError(f"p and q must be vectors of the same length, got {tuple(p.shape)} and {tuple(q.shape)}")
    if integer(k) is None or k < 1:
        raise ValueError(f"K must be an integer >= 1, got {k!r}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    alpha = acceptance_rate(p, q)
    V = p.shape[0]
    n_counts = torch.zeros(k + 1, dtype=torch.long)
    token_counts = torch.zeros(V, dtype=torch.long)
    per_batch = max(1, min(batch, BATCH_ELEMENTS // ((k + 1) * V)))
    q_cdf = q.to(torch.float64).cumsum(0)
    done = 0
    while done < rounds:
        b = min(per_batch, rounds - done)
        draft = _draw(q_cdf, (b, k), generator)
        result = verify(draft, q.expand(b, k, V), p.expand(b, k + 1, V), Randomness.draw(b, k, generator))
        n_counts += torch.bincount(result.n_accepted, minlength=k + 1)
        emitted = result.tokens[result.tokens >= 0]
        token_counts += torch.bincount(emitted, minlength=V)
        done += b
    mean = float((n_counts * torch.arange(1, k + 2)).sum()) / rounds
    return SimulationResult(
        k=k, rounds=rounds, alpha=alpha, expected_tokens=expected_tokens(alpha, k), mean_tokens=mean,
        n_counts=tuple(n_counts.tolist()), n_pmf=tuple(tokens_per_round_pmf(alpha, k)),
        token_counts=tuple(token_counts.tolist()), p=tuple(p.tolist()),
    )


def _draw(cdf: torch.Tensor, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Independent draws from the law whose cumulative sum is `cdf` [V]: the inverse CDF of
    `sample_with_uniform` (the first index whose cumulative weight exceeds u * total, capped at
    the last index with weight), on one shared row: `sample` on q expanded to [B, K, V] copies
    it B x K times for the same law."""
    u = torch.rand(shape, generator=generator, dtype=torch.float64)
    return inverse_cdf(cdf, u * cdf[-1])


def random_pair(vocab: int, generator: torch.Generator, sharpness: float = 1.0,
                closeness: float = 0.8) -> tuple[torch.Tensor, torch.Tensor]:
    """A (p, q) pair over `vocab` tokens for demos: q is p's logits plus noise.

    closeness in [0, 1]: 1 gives q == p, 0 gives independent q.
    """
    logits_p = torch.randn(vocab, generator=generator, dtype=torch.float64) * sharpness
    noise = torch.randn(vocab, generator=generator, dtype=torch.float64) * sharpness
    logits_q = closeness * logits_p + (1 - closeness) * noise
    return torch.softmax(logits_p, 0), torch.softmax(logits_q, 0)
