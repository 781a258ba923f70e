"""Logits -> probabilities, and sampling with explicit randomness.

One function, `logits_to_probs`, turns logits into the distribution a token is
sampled from. The engine calls it for the target (p) and for the draft (q) with
the same `SamplingParams`, so q is exactly the distribution the draft token was
drawn from (a raw, unprocessed q silently breaks losslessness).

Processing order: temperature -> top-k -> top-p -> min-p. Temperature 0 means
greedy and yields a one-hot distribution at the argmax, so greedy decoding runs
through the same verification lines as sampling.

Sampling never touches a global RNG: it takes a `torch.Generator` or the
randomness itself (a uniform per row, `sample_with_uniform`; Exp(1) noise per token,
`sample_with_noise`, for reproducible sampling), which lets tests replay the exact
same randomness through two implementations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from specdecode.checks import integer, real


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How logits become a distribution. The defaults are plain sampling at T=1."""

    temperature: float = 1.0  # 0 => greedy (one-hot argmax)
    top_k: int = 0  # 0 => off; otherwise keep the k most likely tokens
    top_p: float = 1.0  # nucleus: smallest set with mass >= top_p; 1 => off
    min_p: float = 0.0  # drop tokens below min_p * max probability; 0 => off

    def __post_init__(self) -> None:
        temperature, top_k, top_p, min_p = real(self.temperature), integer(self.top_k), real(self.top_p), real(self.min_p)
        if temperature is None or not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if top_k is None or top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if top_p is None or not (0.0 < top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if min_p is None or not (0.0 <= min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        # frozen: normalised once, here (numpy scalars become Python numbers)
        for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams(temperature=0.0)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities over the last dimension; any leading dimensions are batch.

    Float64 logits stay float64 (exactness tests); anything else is computed in
    float32. Raises ValueError on NaN logits or a row with no finite logit.
    """
    x, top, row_max = _checked(logits)
    if params.greedy:
        return torch.zeros_like(x).scatter_(-1, top, 1.0)

    # shifted by the row's top logit first: x / T alone overflows to inf (and softmax to NaN) for a
    # small T (T = 1e-39 in float32); shifted, every entry is <= 0, the top one exactly 0, so any T > 0
    # gives its law, down to the limit of a one-hot top (uniform over exact ties), as T -> 0 should.
    # A T below the dtype's smallest normal number would itself round to 0 there: divide in float64.
    # (One new tensor, divided in place: each further V-sized temporary costs page faults, 0.3 ms a row.)
    dtype = x.dtype
    x = torch.sub(x, row_max)
    if params.temperature < torch.finfo(dtype).tiny:
        x = x.double()
    x.div_(params.temperature)
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    if params.min_p > 0.0:
        keep = probs >= params.min_p * probs.amax(dim=-1, keepdim=True)
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs.to(dtype)


def greedy_token(logits: torch.Tensor) -> int:
    """The token `logits_to_probs(logits, GREEDY)` puts all its mass on, for one row of logits [V]
    (the same checks), without building that one-hot row: a plain greedy step needs only the
    token. Scalar checks, not tensor ops: after a llama.cpp pass has streamed the weights through
    the caches, each small torch op costs tens of microseconds, and the tensor route took 0.26 ms a
    token (the one-hot row, 0.06 ms more)."""
    if not torch.is_tensor(logits) or not logits.is_floating_point() or logits.dim() != 1 or not len(logits):
        raise ValueError("greedy_token takes one row of floating-point logits [vocab]")
    i = int(argmax(logits))
    top = float(logits[i])
    if math.isnan(top):
        raise ValueError(_NAN)
    if top == -math.inf:
        raise ValueError(_NO_FINITE)
    return i


_NAN = "logits contain NaN; the model produced invalid output (check dtype/overflow)"
_NO_FINITE = "logits has a row where every entry is -inf; nothing can be sampled"


def _checked(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits as float32 (float64 kept), each row's argmax and its value [..., 1]; ValueError for what
    cannot be sampled from (not floating point, no vocabulary, NaN, a row of -inf)."""
    if not torch.is_tensor(logits) or not logits.is_floating_point() or logits.dim() < 1:
        raise ValueError("logits must be a floating-point tensor [..., vocab]")
    if logits.shape[-1] == 0:
        raise ValueError("logits has an empty vocabulary dimension")
    x = logits if logits.dtype == torch.float64 else logits.float()
    # argmax takes NaN for the maximum, so the row's top value checks for NaN and for a row of
    # -inf in one pass over V (a separate isnan pass cost as much as the whole greedy step)
    top = argmax(x).unsqueeze(-1)
    row_max = x.gather(-1, top)
    if torch.isnan(row_max).any():
        raise ValueError(_NAN)
    if (row_max == float("-inf")).any():
        raise ValueError(_NO_FINITE)
    return x, top, row_max


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest most-likely set whose mass reaches top_p (at least one token).

    Sorting a 151,936-token row costs 12-14 ms here (40% of a decode step), and the set is usually
    a few dozen tokens: so the most likely 64 are taken first, then 512, 4096, all, until they hold
    mass top_p. Every token after such a window comes after mass top_p, so none of them would be kept:
    the set is a full sort's (tokens tied at its edge are kept in topk's order, as in sort's)."""
    window = min(_TOP_P_WINDOW, probs.shape[-1])
    while True:
        sorted_probs, order = torch.topk(probs, window, dim=-1)  # descending
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        if window == probs.shape[-1] or bool((cumulative[..., -1] >= top_p).all()):
            break
        window = min(window * 8, probs.shape[-1])
    mass_before = cumulative - sorted_probs
    keep_sorted = mass_before < top_p
    # the most likely token always stays: a top_p below the dtype's smallest float rounds to 0 in the
    # comparison, which would keep nothing (and 0 / 0 is NaN)
    keep_sorted[..., 0] = True
    kept = sorted_probs * keep_sorted  # normalised in the window, then put in place: one V-sized pass, not four
    return torch.zeros_like(probs).scatter_(-1, order, kept / kept.sum(dim=-1, keepdim=True))


_TOP_P_WINDOW = 64  # the most likely tokens top-p looks at first (then 8x more, until they hold its mass)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`torch.argmax(x, dim=-1)`: the first maximum of each row, NaN counting as the maximum; through
    numpy for a float32/float64 CPU tensor, whose argmax is 10x faster here (0.012 against 0.127 ms for
    a 151,936-token row with torch 2.13 on this CPU), and a greedy step takes two."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or x.requires_grad:
        return torch.argmax(x, dim=-1)
    return torch.from_numpy(np.asarray(np.argmax(x.numpy(), axis=-1), dtype=np.int64))


def exponential_noise(shape: tuple[int, ...], generator: torch.Generator | None,
                      dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu") -> torch.Tensor:
    """Exp(1) noise for `sample_with_noise`, drawn from an explicit generator.

    Drawn where the generator lives (the engine's is a CPU generator; None: the CPU default),
    then moved to `device`: a seed gives the same noise whatever device the model runs on.
    """
    where = generator.device if generator is not None else torch.device("cpu")
    noise = torch.empty(shape, dtype=dtype, device=where).exponential_(1.0, generator=generator)
    return noise.to(device)


def sample_with_noise(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Sample index i with probability weights[i] / sum(weights), given Exp(1) noise.

    The exponential race: argmax_i w_i / E_i with E_i ~ Exp(1) iid picks i with
    probability w_i / sum w (E_i / w_i ~ Exp(w_i), and the smallest of independent
    exponentials is index i with probability proportional to its rate). It needs
    no normalisation and never picks a zero-weight index while any weight is > 0.
    """
    tiny = torch.finfo(noise.dtype).tiny
    return argmax(weights.to(noise.dtype) / noise.clamp_min(tiny))


def sample(probs: torch.Tensor, generator: torch.Generator | None, greedy: bool = False) -> torch.Tensor:
    """Draw one index per row of `probs` [..., V] using an explicit generator.

    greedy=True says the rows are one-hot (`logits_to_probs` at temperature 0): the
    only possible index is the argmax, so no noise is drawn (it would cost a V-sized
    pass of exponentials per token for the same result).
    """
    if greedy:
        return argmax(probs)
    where = generator.device if generator is not None else torch.device("cpu")
    u = torch.rand(tuple(probs.shape[:-1]), generator=generator, dtype=torch.float64, device=where)
    return sample_with_uniform(probs, u.to(probs.device))


def sample_with_uniform(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample index i with probability weights[i] / sum(weights), given u ~ U[0, 1) per row.

    Inverse CDF in float64: the first i whose cumulative weight exceeds t = u * total. One
    uniform per row instead of V exponentials. In two levels, because a float64 cumulative sum
    is a scalar loop (a 151,936-token row: 1.1 ms per generated token, against 0.15 ms):
    the blocks' totals, then the one block holding t, each summed in float64. A zero-weight
    index is never picked: the cumulative sum does not rise there, and each level is capped at
    its last entry with weight (where t rounds up to the total, or a block's own sum rounds
    below t).
    """
    w = weights.to(torch.float64)
    t = u.to(torch.float64).unsqueeze(-1)
    if w.shape[-1] <= 2 * _BLOCK:
        cdf = w.cumsum(dim=-1)
        return inverse_cdf(cdf, t * cdf[..., -1:]).squeeze(-1)
    blocks = torch.nn.functional.pad(w, (0, -w.shape[-1] % _BLOCK)).unflatten(-1, (-1, _BLOCK))  # [..., nb, B]
    ends = blocks.sum(dim=-1).cumsum(dim=-1)  # where each block's cumulative weight ends
    t = t * ends[..., -1:]
    b = inverse_cdf(ends, t)  # the block holding t (it has weight)
    start = torch.where(b > 0, ends.gather(-1, (b - 1).clamp_min(0)), torch.zeros_like(t))
    inside = blocks.gather(-2, b.unsqueeze(-1).expand(*b.shape, _BLOCK)).squeeze(-2).cumsum(dim=-1) + start
    return (b * _BLOCK + inverse_cdf(inside, t)).squeeze(-1)


_BLOCK = 1024  # entries per block of the two-level inverse CDF (sample_with_uniform)


def inverse_cdf(cdf: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The first index whose cumulative weight exceeds t [..., 1], capped at the last index with
    weight (the first that reaches the row's end value)."""
    i = torch.searchsorted(cdf, t, right=True)
    return torch.minimum(i, (cdf < cdf[..., -1:]).sum(dim=-1, keepdim=True))
