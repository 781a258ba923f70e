"""Argument checks shared by the library's entry points (configs, the decoder, the theory)."""

from __future__ import annotations

import numbers


def integer(value: object) -> int | None:
    """`value` as a Python int if it is an integer (numpy's integer scalars included: a budget
    computed with numpy, `np.int64(64)`, is an integer), else None. A bool is not an integer here:
    `max_new_tokens=True` is a mistake, not 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def real(value: object) -> float | None:
    """`value` as a Python float if it is a real number (numpy's float32 included; a bool is not), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def require_integers(config: object, *names: str) -> None:
    """A ValueError naming the first of these fields of `config` that is not an integer (see `integer`)."""
    for name in names:
        if integer(getattr(config, name)) is None:
            raise ValueError(f"{name} must be an integer, got {getattr(config, name)!r}")


def check_utf8(text: str, what: str) -> None:
    """A ValueError naming `what` if `text` holds a lone surrogate: invalid UTF-8 from argv (Python's
    surrogateescape), which no tokenizer encodes and no generated text can match."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid UTF-8 (it holds {text[exc.start:exc.end]!r} at character "
                         f"{exc.start}): give it as UTF-8 text") from None
