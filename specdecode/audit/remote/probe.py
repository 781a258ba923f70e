"""Before sampling: what both servers accept, found with a few one-token requests.

Each optional sampling field (top_p, top_k, min_p) is sent once at a value the settings use; a server
that refuses it (a 400) has the settings that need it skipped, with a note. Where a field is
accepted, its off value (top_k 0, or vLLM's -1; min_p 0) is sent explicitly in the other settings, so
a server's own defaults (llama-server's top-k 40, min-p 0.05) do not apply unseen. Logprobs are asked
for (with up to `top_logprobs` alternatives) where both sides give them: they give the answers'
tokens (the law of the first 1, 2 tokens of a 3-token answer), the reference's probabilities (the
one-sample test) and the top-2 margin of a greedy divergence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.audit.remote.client import Client, EndpointError, Refused, Side
from specdecode.audit.remote.plan import Prompt, Setting

OFF = {"top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,)}  # each field's values that turn it off
TOP_LOGPROBS_TRIES = (20, 5)  # OpenAI's legacy completions allow at most 5


@dataclass
class Capabilities:
    kinds: set[bool] = field(default_factory=set)  # chat (True) and/or completions (False)
    off: dict[str, object] = field(default_factory=dict)  # accepted optional field -> its off value (None: none)
    refused: set[str] = field(default_factory=set)  # optional fields a side refused
    logprobs: dict[bool, dict] = field(default_factory=dict)  # kind -> the request fields that ask for them
    tokens: dict[bool, bool] = field(default_factory=dict)  # kind -> both sides report the answers' tokens
    top: dict[bool, bool] = field(default_factory=dict)  # kind -> the reference reports probabilities too
    notes: list[str] = field(default_factory=list)

    def sampling_fields(self, setting: Setting) -> dict:
        """The fields a request at `setting` carries: temperature, then each accepted optional field at the
        setting's value (or its off value, where the server has one)."""
        out: dict = {"temperature": setting.temperature}
        for name, off in self.off.items():
            value = getattr(setting, name)
            if name in setting.uses:
                out[name] = value
            elif off is not None:
                out[name] = off
        return out


async def probe(client: Client, sides: tuple[Side, Side], prompts: tuple[Prompt, ...],
                settings: tuple[Setting, ...], top_logprobs: int) -> Capabilities:
    caps = Capabilities()
    examples = {p.chat: p for p in reversed(prompts)}  # the first prompt of each kind
    for chat, prompt in sorted(examples.items()):
        try:
            for side in sides:
                await client.complete(side, {**prompt.fields(), "max_tokens": 1, "temperature": 1.0}, chat)
        except Refused as exc:
            kind = "chat" if chat else "completion"
            if exc.status in (404, 405):
                caps.notes.append(f"{side.name} has no {kind} endpoint ({exc}): its prompts are skipped")
                continue
            raise EndpointError(f"{side.name} refused a plain {kind} request: {exc}; see what --body / "
                                f"--reference-body add to every request") from None
        caps.kinds.add(chat)
    if not caps.kinds:
        raise EndpointError("the servers accept neither completion nor chat requests: " + "; ".join(caps.notes))
    chat = min(caps.kinds)  # completions where available: the plainest request
    base = {**examples[chat].fields(), "max_tokens": 1, "temperature": 1.0}
    used = set().union(*(s.uses for s in settings))
    for name in sorted(OFF):  # every field, used or not: off explicitly beats a server's default
        on = next((getattr(s, name) for s in settings if name in s.uses), None)
        if on is not None and not await _accepted(client, sides, {**base, name: on}, chat):
            caps.refused.add(name)
            caps.notes.append(f"{name} refused by a server: the settings with {name.replace('_', '-')} are skipped")
            continue
        caps.off[name] = None
        for off in OFF[name]:
            if await _accepted(client, sides, {**base, name: off}, chat):
                caps.off[name] = off
                break
        if caps.off[name] is None and name not in used:
            caps.off.pop(name)  # neither used nor switchable off: left to the server
        elif caps.off[name] is None:
            caps.notes.append(f"{name} is accepted but no off value is ({', '.join(map(str, OFF[name]))}): the "
                              f"settings without it get each server's default")
    if top_logprobs:
        for kind in sorted(caps.kinds):
            await _probe_logprobs(client, sides, caps, {**examples[kind].fields(), "max_tokens": 2,
                                                        "temperature": 1.0}, kind, top_logprobs)
    return caps


async def _accepted(client: Client, sides: tuple[Side, Side], request: dict, chat: bool) -> bool:
    try:
        for side in sides:
            await client.complete(side, request, chat)
    except Refused:
        return False
    return True


async def _probe_logprobs(client: Client, sides: tuple[Side, Side], caps: Capabilities, request: dict, chat: bool,
                          top_logprobs: int) -> None:
    for n in sorted({min(top_logprobs, t) for t in TOP_LOGPROBS_TRIES}, reverse=True):
        fields = {"logprobs": True, "top_logprobs": n} if chat else {"logprobs": n}
        try:
            answers = [await client.complete(side, {**request, **fields}, chat) for side in sides]
        except Refused:
            continue
        if all(a.tokens is not None for a in answers):
            caps.logprobs[chat] = fields
            caps.tokens[chat] = True
            caps.top[chat] = answers[1].top is not None and bool(answers[1].top and answers[1].top[0])
            return
    caps.notes.append(f"no logprobs from both servers for {'chat' if chat else 'completion'} requests: the law of "
                      f"the first tokens is tested on whole answers only, without the one-sample test")
