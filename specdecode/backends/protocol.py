"""The model protocol: everything the engine asks of a language model.

A backend owns one sequence's KV cache. `forward` appends tokens at positions
length .. length+n-1 and returns next-token logits for the last `n_logits` of
them; `truncate` rolls the cache back (rejected drafts) and must be cheap.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class Model(Protocol):
    name: str
    vocab_size: int  # logits width
    max_length: int  # context limit in tokens

    @property
    def length(self) -> int:
        """Tokens currently held in the cache."""

    def forward(self, tokens: Sequence[int], n_logits: int = 1) -> torch.Tensor:
        """Run `tokens` after the cache; return logits [n_logits, vocab] for the last n_logits inputs."""

    def truncate(self, length: int) -> None:
        """Keep only the first `length` cached positions."""
