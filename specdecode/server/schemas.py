"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic.

Defaults follow OpenAI (temperature 1, top_p 1, max_tokens 16 for completions).
Fields that would change the output in ways we do not implement (penalties,
logprobs, n > 1) are rejected with a 400 rather than silently ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class SpecOptions(BaseModel):
    """The `specdecode` extension field: per-request speculation settings."""

    model_config = ConfigDict(extra="forbid")
    k: int | None = Field(default=None, ge=1, le=64)  # None = the server's policy
    speculative: bool = True


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | int | None = None
    specdecode: SpecOptions = SpecOptions()

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
    def _unsupported(self):
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported (they would change "
                             "the target's distribution)")
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        return self

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())


class CompletionRequest(_Common):
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        prompts = [v] if isinstance(v, str) else v
        if len(prompts) != 1 or not prompts[0]:
            raise ValueError("prompt must be one non-empty string")
        return prompts[0]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Common):
    messages: list[Message]

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v):
        if not v:
            raise ValueError("messages must not be empty")
        return v
