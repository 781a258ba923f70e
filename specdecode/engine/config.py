"""Generation settings, frozen: one object per request, never mutated."""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.checks import SettingError, check_utf8, integer
from specdecode.core import VERIFY_RULES
from specdecode.core.probs import SamplingParams

DRAFTER_CHOICES = ("auto", "model", "lookup", "suffix")  # SpeculativeDecoder.load(drafter=...), --drafter
# the server's prompt tokens per pass while requests run (engine/scheduler.py, --prefill-chunk): smaller
# pieces stall the running streams for less, larger ones compute more prompt tokens a second
# (benchmarks/prefill_stall.py measures the trade)
DEFAULT_PREFILL_TOKENS = 256

# seeds are 0 .. SEED_LIMIT - 1: torch's generator keeps 63 bits of a seed, so s and s + 2**63 would draw
# alike under two reported seeds
SEED_LIMIT = 2 ** 63

# reproducible sampling's acceptance is its own rule, so no other chain rule may be asked for (the server's
# check names the field with this message)
REPRODUCIBLE_VERIFIES_BY_EQUALITY = ("reproducible sampling verifies by equality with the target's own choice: "
                                     "leave verification at token")


def check_seed(seed: object) -> int:
    """`seed` as an int, or a ValueError naming the range: the one check of a seed, which the config,
    the server's request schema and the CLI's --seed all use."""
    value = integer(seed)
    if value is None or not 0 <= value < SEED_LIMIT:
        raise ValueError(f"must be an integer from 0 to 2**63 - 1, got {seed!r}")
    return value


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams(temperature=0.0)
    k: int | None = None  # drafts per round; None = adaptive K (plain decoding: speculative=False)
    seed: int = 0
    stop: tuple[str, ...] = ()  # stop strings (text level); one str is one stop string, as in OpenAI's API
    # the exact verification rule (core.VERIFY_RULES): "token" (Leviathan et al.'s, token by
    # token) or "block" (Sun et al.'s, the draft judged as a whole: never fewer tokens per round)
    verification: str = "token"
    # reproducible sampling (core/reproducible.py): each position's token a function of (seed,
    # position, p), drafts accepted iff equal to it, so the output equals plain decoding with the
    # same seed whatever K, drafter or batch; same law, lower acceptance than the rules above
    reproducible: bool = False

    def __post_init__(self) -> None:
        max_new_tokens, k = integer(self.max_new_tokens), integer(self.k)
        if max_new_tokens is None or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.k is not None and (k is None or k < 1):
            raise SettingError(f"{{k}} must be an integer >= 1 (for plain decoding use {{speculative=False}}), "
                               f"got {self.k!r}")
        try:
            seed = check_seed(self.seed)
        except ValueError as exc:
            raise ValueError(f"seed {exc}") from None
        # frozen: normalised once, here (numpy integers become ints)
        object.__setattr__(self, "max_new_tokens", max_new_tokens)
        object.__setattr__(self, "k", k)
        object.__setattr__(self, "seed", seed)
        if not isinstance(self.verification, str) or self.verification not in VERIFY_RULES:
            raise ValueError(f"verification must be one of {', '.join(VERIFY_RULES)}, got {self.verification!r}")
        if not isinstance(self.reproducible, bool):
            raise ValueError(f"reproducible must be true or false, got {self.reproducible!r}")
        if self.reproducible and self.verification != "token":
            raise ValueError(REPRODUCIBLE_VERIFIES_BY_EQUALITY)
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)):  # a str is one stop string, not a sequence of characters
            raise TypeError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        for i, s in enumerate(stop):
            check_utf8(s, f"stop string {i}")
        object.__setattr__(self, "stop", tuple(stop))  # frozen: normalised once, here
