"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic.

Defaults follow OpenAI (temperature 1, top_p 1, max_tokens 16 for completions).
Validation is strict (no "3" -> 3 or true -> 1 coercion) and unknown fields are
rejected (extra="forbid"): a field we silently ignored would change nothing the
client asked for without telling it. Fields that would change the output in ways
we do not implement (penalties, logprobs, tools, ...) are accepted only at their
no-op value and otherwise rejected with a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from specdecode.engine.config import REPRODUCIBLE_VERIFIES_BY_EQUALITY, check_seed


class FieldError(ValueError):
    """A ValueError from a model-level check that still names its field (pydantic gives it no location)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def _encodable(s: str) -> str:
    # a lone surrogate ("\ud800", legal in JSON) cannot be UTF-8 encoded and makes tokenizers raise
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the text contains a lone UTF-16 surrogate (invalid Unicode)") from None
    return s


Text = Annotated[str, AfterValidator(_encodable)]
Seed = Annotated[int, AfterValidator(check_seed)]  # 0 .. 2**63 - 1, the engine's range (OpenAI's is int64)

# Unsupported fields and the values at which they do nothing (so clients that send defaults still work).
_NO_OP = {
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logprobs": (None, False),
    "logit_bias": (None, {}),
    "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
    "top_logprobs": (None, 0), "tools": (None, []), "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    # chat fields about storage, billing and tools, which change nothing about the text at these values
    "store": (None, False), "metadata": (None, {}), "parallel_tool_calls": (None, True, False),
    "service_tier": (None, "auto", "default"),
}
# in completions `logprobs` is a count, and 0 still asks for the sampled token's logprob: only null is a no-op
_COMPLETION_NO_OP = {**_NO_OP, "logprobs": (None,)}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SpecOptions(_Strict):
    """The `specdecode` extension field: per-request speculation settings."""

    k: int | None = Field(default=None, ge=1, le=64)  # None = the server's policy
    speculative: bool = True
    verification: Literal["token", "block"] = "token"  # the exact rule (core.VERIFY_RULES); same output law
    reproducible: bool = False  # reproducible sampling (core/reproducible.py): same seed, same text, any K/batch

    @model_validator(mode="after")
    def _speculation_fields_need_speculation(self):
        # without speculation there are no drafts, so K and the rule that verifies drafts would be
        # silently ignored; reproducible stays allowed: plain decoding samples from its noise too
        if not self.speculative:
            if self.k is not None:
                raise FieldError("specdecode.k", "k sets the drafts per round, which needs speculation: "
                                                 "drop k or speculative: false")
            if self.verification != "token":
                raise FieldError("specdecode.verification", "verification applies to drafts, which need "
                                                            "speculation: drop verification or speculative: false")
        if self.reproducible and self.verification != "token":  # GenerationConfig's rule, with its field named
            raise FieldError("specdecode.verification", REPRODUCIBLE_VERIFIES_BY_EQUALITY)
        return self


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    NO_OPS: ClassVar[dict] = _NO_OP  # unsupported fields and their do-nothing values
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    # allow_inf_nan off: JSON's NaN would otherwise be reported as "should be less than or equal to 2"
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=-1)  # 0 = off; -1 = off too (vLLM's way of saying it), read as 0
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)  # 0 = off
    stop: Text | list[Text] | None = None
    seed: Seed | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    specdecode: SpecOptions = SpecOptions()
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logprobs: Any = None
    logit_bias: Any = None
    user: str | None = None  # metadata only, unused; still typed, as OpenAI documents it

    @field_validator(*_NO_OP, mode="before", check_fields=False)
    @classmethod
    def _no_op_only(cls, v, info: ValidationInfo):
        allowed = cls.NO_OPS[info.field_name]
        if allowed is not None and not any(type(v) is type(a) and v == a for a in allowed):
            values = [json.dumps(a) for a in allowed]
            accepted = " or ".join([", ".join(values[:-1]), values[-1]] if len(values) > 2 else values)
            raise ValueError(f"{info.field_name} is not supported: leave it out, or send {accepted} (which do nothing)")
        return v

    @field_validator("temperature", "top_p", "top_k", "min_p", "n", "stream", mode="before")
    @classmethod
    def _null_is_the_default(cls, v, info: ValidationInfo):
        """OpenAI's schema lets these be null, meaning the default (clients send null for "unset")."""
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, v: int) -> int:
        return max(v, 0)  # -1 and 0 both mean off: the engine knows one of them

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n = 1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        return stops

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "only allowed with stream=true")
        return self

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    @property
    def limit(self) -> int | None:
        """The requested completion length, if any."""
        return self.max_tokens


class CompletionRequest(_Common):
    NO_OPS: ClassVar[dict] = _COMPLETION_NO_OP
    prompt: Text | list[Text]
    echo: Any = None
    best_of: Any = None
    suffix: Any = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        prompts = [v] if isinstance(v, str) else v
        if len(prompts) != 1 or not prompts[0]:
            raise ValueError("prompt must be one non-empty string")
        return prompts[0]


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]  # developer: OpenAI's newer name for system
    content: Text
    name: Any = None  # OpenAI's participant name: rejected below, the chat template has no place for it

    @field_validator("role")
    @classmethod
    def _developer_is_system(cls, v: str) -> str:
        return "system" if v == "developer" else v  # the name chat templates know

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v):
        """OpenAI's content parts: text parts are joined with newlines (as vLLM does); other kinds refused."""
        if not isinstance(v, list):
            return v
        texts = []
        for i, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                of = f" (it has type {kind!r})" if isinstance(kind, str) and kind != "text" else ""
                raise ValueError(f"part {i} is not a text part{of}: only parts {{\"type\": \"text\", \"text\": "
                                 f"<a string>}} are supported")
            texts.append(part["text"])
        if not texts:
            raise ValueError("an empty list of parts: give a string or at least one text part")
        return "\n".join(texts)

    @field_validator("name", mode="before")
    @classmethod
    def _no_name(cls, v):
        if v is not None:
            raise ValueError("name is not supported (the chat template has no place for it): leave it out")
        return v


class ChatRequest(_Common):
    messages: list[Message]
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's current name for max_tokens
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None
    store: Any = None
    metadata: Any = None
    parallel_tool_calls: Any = None
    service_tier: Any = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v):
        if not v:
            raise ValueError("messages must not be empty")
        return v

    @model_validator(mode="after")
    def _one_limit(self):
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise FieldError("max_completion_tokens", "conflicts with max_tokens; send one of them")
        return self

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
