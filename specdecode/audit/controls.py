"""Deliberately broken verification rules: negative controls the audit must flag.

Each reproduces a bug class that shipped in real projects. They are never used
for generation; they exist so a user can see that the audit has statistical power.
"""

from __future__ import annotations

import torch

from specdecode.core.probs import sample_with_noise
from specdecode.core.verify import Randomness, VerifyResult, verify


def always_accept(draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, rand: Randomness,
                  lengths: torch.Tensor | None = None) -> VerifyResult:
    """BROKEN: accepts every draft (the output follows q, not p), then a bonus token from p."""
    B, K = draft_tokens.shape
    bonus = sample_with_noise(p[:, K], rand.noise)
    return VerifyResult(torch.full((B,), K, dtype=torch.long), torch.cat([draft_tokens, bonus[:, None]], 1))


def residual_from_p(draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, rand: Randomness,
                    lengths: torch.Tensor | None = None) -> VerifyResult:
    """BROKEN: after a rejection, resamples from p instead of the residual max(0, p - q)."""
    result = verify(draft_tokens, q, p, rand, lengths)
    rows = torch.arange(draft_tokens.shape[0])
    n = result.n_accepted
    rejected = n < draft_tokens.shape[1]
    tokens = result.tokens.clone()
    resampled = sample_with_noise(p[rows, n], rand.noise)
    tokens[rows, n] = torch.where(rejected, resampled, tokens[rows, n])
    return VerifyResult(n, tokens)


CONTROLS = {"always-accept": always_accept, "residual-from-p": residual_from_p}
