"""The CLI's names for the library's parameters: one mapping, from a parameter a library error names
(`checks.SettingError`: `n_ctx`, `drafter='lookup'`) to the option a user gives (`--n-ctx`,
`--drafter lookup`)."""

from __future__ import annotations

from specdecode.checks import SettingError

# parameter -> option (the library's SpeculativeDecoder.load and GenerationConfig names)
FLAGS = {
    "target": "--target", "draft": "--draft", "drafter": "--drafter", "backend": "--backend", "dtype": "--dtype",
    "device": "--device", "threads": "--threads", "n_ctx": "--n-ctx", "draft_int8": "--draft-int8",
    "draft_vocab": "--draft-vocab", "draft_confidence": "--draft-confidence", "tree": "--tree",
    "max_batch": "--max-batch", "chat": "--chat", "k": "--k",
}
# a parameter whose value is an option of its own
VALUE_FLAGS = {("speculative", "False"): "--no-spec", ("draft_int8", "False"): "--no-draft-int8"}


def cli_setting(name: str, value: str | None) -> str:
    """How a user gives parameter `name` (= `value`) on the command line."""
    if (name, value) in VALUE_FLAGS:
        return VALUE_FLAGS[name, value]
    flag = FLAGS[name]
    return flag if value is None else f"{flag} {value}"


def cli_message(exc: BaseException) -> str:
    """An error's message in the CLI's words: a SettingError names options, not parameters."""
    return exc.render(cli_setting) if isinstance(exc, SettingError) else str(exc)
