"""Argument checks shared by the library's entry points (configs, the decoder, the theory)."""

from __future__ import annotations

import numbers
import re
from typing import Callable


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


class SettingError(ValueError):
    """A ValueError about the library's own parameters, which its message names as `{name}` or
    `{name=value}` in `template`. str() reads them as Python calls them (`backend='transformers'`);
    a front end renders them as its user sets them (the CLI: `--backend transformers`, cli/flags.py),
    so library code never quotes another layer's options."""

    def __init__(self, template: str) -> None:
        self.template = template
        super().__init__(self.render(python_setting))

    def __reduce__(self):  # pickled with its template (the bench's workers send it to the CLI's process)
        return SettingError, (self.template,)

    def render(self, setting: Callable[[str, str | None], str]) -> str:
        """The message with each `{name}` / `{name=value}` replaced by setting(name, value or None)."""
        return _SETTING.sub(lambda m: setting(m[1], m[2]), self.template)


_SETTING = re.compile(r"\{([a-z_][a-z0-9_]*)(?:=([^{}]*))?\}")


def python_setting(name: str, value: str | None) -> str:
    """A parameter as a Python call writes it: `n_ctx`, `drafter='lookup'`, `speculative=False`."""
    if value is None:
        return name
    literal = value in ("True", "False", "None") or value.lstrip("-").replace(".", "", 1).isdigit()
    return f"{name}={value}" if literal else f"{name}={value!r}"
