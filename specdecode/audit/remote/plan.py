"""What the black-box audit asks: prompts, sampling settings, and the groups of identical requests.

A group is one prompt at one setting and one max_tokens, sent `samples` times to each side. The
settings sweep the places the known bugs hid: two temperatures, then top-p, top-k and min-p (each
where both servers accept the field). Short groups (max_tokens 3) give the law of the first tokens;
the boundary group (a longer max_tokens with a stop string) gives the law of where an answer ends,
by a stop or by its length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

MAX_TEMPERATURE = 2.0  # OpenAI's bound: a control's perturbed temperature stays at or below it


@dataclass(frozen=True, slots=True)
class Prompt:
    """A completion prompt (`text`) or a chat (`messages`: (role, content) pairs), and the stop strings
    of its boundary group."""

    name: str
    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    stop: tuple[str, ...] = ()

    @property
    def chat(self) -> bool:
        return self.messages is not None

    def fields(self) -> dict:
        if self.chat:
            return {"messages": [{"role": role, "content": content} for role, content in self.messages]}
        return {"prompt": self.text}


@dataclass(frozen=True, slots=True)
class Setting:
    """Sampling fields; 0 (top_k, min_p) and 1 (top_p) are off."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"a setting's temperature must be in (0, {MAX_TEMPERATURE:g}] (greedy is checked "
                             f"apart), got {self.temperature:g}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p:g}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p:g}")

    @property
    def uses(self) -> frozenset[str]:
        """The optional fields this setting turns on."""
        on = {"top_p": self.top_p < 1, "top_k": self.top_k > 0, "min_p": self.min_p > 0}
        return frozenset(name for name, used in on.items() if used)

    def scaled(self, factor: float) -> "Setting":
        return replace(self, temperature=min(MAX_TEMPERATURE, self.temperature * factor))

    @property
    def label(self) -> str:
        parts = [f"T {self.temperature:g}"]
        parts += [f"top-p {self.top_p:g}"] if self.top_p < 1 else []
        parts += [f"top-k {self.top_k}"] if self.top_k else []
        parts += [f"min-p {self.min_p:g}"] if self.min_p else []
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class Group:
    """One prompt, one setting, one max_tokens (with the boundary group's stop strings)."""

    prompt: Prompt
    setting: Setting
    max_tokens: int
    boundary: bool = False  # the stop/length group: its law is where the answer ends

    @property
    def label(self) -> str:
        what = f"max {self.max_tokens}" + (f", stop {' '.join(map(repr, self.prompt.stop))}"
                                          if self.boundary and self.prompt.stop else "")
        return f"{self.prompt.name} | {self.setting.label} | {what}"


# Prompts whose next tokens are uncertain (a continuation, a phrasing, a guess), in both request kinds; the
# first two change most with the temperature (the control sees a change of x1.25 in 200 answers a side).
DEFAULT_PROMPTS = (
    Prompt("completion: code", text="import random\n\n\ndef shuffle(items):\n    ", stop=("\n",)),
    Prompt("chat: a colour", messages=(("user", "Name one colour and say why you like it, in a few words."),),
           stop=(".",)),
    Prompt("chat: a number", messages=(("user", "Pick a random number from 1 to 50. Reply with the number "
                                                "only."),), stop=("\n",)),
    Prompt("completion: animals", text="Here is a list of animals, in no particular order:\n1.", stop=("\n",)),
)
QUICK_PROMPTS = DEFAULT_PROMPTS[:2]
DEFAULT_SETTINGS = (Setting(1.0), Setting(0.7), Setting(1.0, top_p=0.9), Setting(1.0, top_k=20),
                    Setting(1.0, min_p=0.1))
QUICK_SETTINGS = DEFAULT_SETTINGS[:1]


def build_plan(prompts: tuple[Prompt, ...], settings: tuple[Setting, ...], max_tokens: tuple[int, ...],
               boundary_tokens: int) -> list[Group]:
    """Every prompt at every setting for each short max_tokens; and each prompt's boundary group (at the
    first setting) when boundary_tokens > 0."""
    groups = [Group(p, s, m) for p in prompts for s in settings for m in max_tokens]
    if boundary_tokens:
        groups += [Group(p, settings[0], boundary_tokens, boundary=True) for p in prompts]
    return groups


def parse_setting(text: str) -> Setting:
    """`temperature=0.7,top_p=0.9` (keys: temperature, top_p, top_k, min_p) as a Setting."""
    fields: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in ("temperature", "top_p", "top_k", "min_p"):
            raise ValueError(f"{text!r}: give key=value pairs of temperature, top_p, top_k, min_p "
                             f"(such as temperature=0.7,top_p=0.9)")
        if key in fields:
            raise ValueError(f"{text!r} gives {key} twice: give each key once")
        try:
            fields[key] = int(value) if key == "top_k" else float(value)
        except ValueError:
            what = "a whole number" if key == "top_k" else "a number"
            raise ValueError(f"{text!r}: {key} must be {what}, got {value.strip()!r}") from None
    if "temperature" not in fields:
        raise ValueError(f"{text!r}: give a temperature > 0 (greedy is checked apart)")
    return Setting(**fields)


def load_prompts(path: str) -> tuple[Prompt, ...]:
    """A JSON file: a list whose items are a string (a completion prompt) or an object with "prompt" or
    "messages" (OpenAI's), and optionally "name" and "stop" (a string or a list)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"--prompts {path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"--prompts {path}: not a JSON file ({exc})") from None
    except OSError as exc:  # a folder, a file it may not read
        raise ValueError(f"--prompts {path}: cannot read it ({exc.strerror or exc}): give a JSON file") from None
    try:
        doc = strict_json(text)
    except ValueError as exc:
        raise ValueError(f"--prompts {path}: not a JSON file ({exc})") from None
    if not isinstance(doc, list) or not doc:
        raise ValueError(f"--prompts {path}: give a JSON list of prompts (strings or objects with \"prompt\" or "
                         f"\"messages\")")
    prompts = tuple(_prompt(item, i, path) for i, item in enumerate(doc))
    names = [p.name for p in prompts]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--prompts {path}: the name {twice[0]!r} is given to more than one prompt: give each "
                         f"its own (the report's groups go by name)")
    return prompts


def strict_json(text: str):
    """JSON as the standard has it: no NaN or Infinity (a server would refuse them, after the audit had
    connected), and nesting a reader can follow; a ValueError saying which rule it broke."""
    def constant(name: str):
        raise ValueError(f"{name} is not a JSON value")

    try:
        value = json.loads(text, parse_constant=constant)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{exc.msg} at character {exc.pos}") from None
    except RecursionError:
        raise ValueError("nested too deep") from None
    if _depth(value) > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    return value


MAX_DEPTH = 32  # of --body and --prompts: far beyond any request field, well within what a server parses


def _depth(value, level: int = 0) -> int:
    if level > MAX_DEPTH or not isinstance(value, (dict, list)):
        return level
    items = value.values() if isinstance(value, dict) else value
    return max((_depth(v, level + 1) for v in items), default=level + 1)


PROMPT_FIELDS = {"name", "prompt", "messages", "stop"}


def _prompt(item, i: int, path: str) -> Prompt:
    where = f"--prompts {path}: item {i + 1}"
    if isinstance(item, str):
        item = {"prompt": item}
    if not isinstance(item, dict) or ("prompt" in item) == ("messages" in item):
        raise ValueError(f"{where} must be a string or an object with one of \"prompt\" and \"messages\"")
    unknown = sorted(set(item) - PROMPT_FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} (a prompt has {', '.join(sorted(PROMPT_FIELDS))}; "
                         f"sampling settings go in --setting, other request fields in --body)")
    if "name" in item and (not isinstance(item["name"], str) or not item["name"].strip()):
        raise ValueError(f"{where}: \"name\" must be a non-empty string")
    stop = item.get("stop", ())
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"{where}: \"stop\" must be a non-empty string or a list of them")
    kind = "chat" if "messages" in item else "completion"
    name = item.get("name") or f"{kind} {i + 1}"
    if "prompt" in item:
        if not isinstance(item["prompt"], str) or not item["prompt"]:
            raise ValueError(f"{where}: \"prompt\" must be a non-empty string")
        return Prompt(str(name), text=item["prompt"], stop=tuple(stop))
    messages = item["messages"]
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ValueError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} strings")
    return Prompt(str(name), messages=tuple((m["role"], m["content"]) for m in messages), stop=tuple(stop))
