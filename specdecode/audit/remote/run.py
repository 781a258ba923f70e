"""The black-box audit: is an OpenAI-compatible endpoint's law with speculation on its law without?

Two sides answer the same requests: the endpoint (speculation on) and the reference (a deployment
without speculation, or the same server told per request to turn it off). For every group (a prompt,
a sampling setting, a max_tokens) each side answers `samples` times, interleaved so that both meet the
same load; the statistics of `compare` test each group's two samples. False failures: each of the m
tests runs at level / m (Bonferroni), so a lossless endpoint fails any with probability <= level.

The negative control shows the run could see a loss: the reference against itself at a temperature
x1.25 (on each prompt's first group), by the same tests, must reject on one of them at least; else the
verdict is inconclusive. Each test reports the smallest total-variation distance (over its cells) it
detects with 90% power (`stats.detectable_tv`); the run's is the largest of them. Greedy answers
(temperature 0) are compared one request at a time, so no batch neighbour changes their numerics.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Sequence

from tqdm.auto import tqdm

from specdecode.audit.remote.client import Answer, Client, EndpointError, Side, model_option
from specdecode.audit.remote.compare import (END, Comparison, against_law, first_token_law, greedy_check,
                                             probe_answers, probe_temperature, statistics, tie_probe, two_sample)
from specdecode.audit.remote.plan import Group, Prompt, Setting, build_plan
from specdecode.audit.remote.probe import Capabilities, probe
from specdecode.audit.remote.report import RemoteReport


SPECULATION_OFF = {"specdecode": {"speculative": False}}  # our server's per-request switches
SPECULATION_PINNED = {"specdecode": {"k": 2}}  # two drafts a round: all a 3-token answer's first round can check


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    samples: int = 300  # answers per side per group
    level: float = 1e-3  # overall false-failure probability of the statistical tests
    power: float = 0.9  # of the detectable-TV figures
    concurrency: int = 4  # requests in flight, over both sides
    timeout: float = 120.0  # seconds for one answer
    greedy_tokens: int = 32  # max_tokens of the greedy checks (0 = none)
    max_tokens: tuple[int, ...] = (3,)  # the short groups' max_tokens
    boundary_tokens: int = 16  # the boundary group's max_tokens (0 = none)
    control_factor: float = 1.25  # the control's temperature, relative to its group's
    tie_margin: float = 0.25  # a greedy divergence within this many nats of the top logprob is numerics
    top_logprobs: int = 20  # alternatives asked per token where logprobs are accepted (0 = never ask)
    retries: int = 6  # tries of a request that met a 429/503, a dropped connection or a timeout

    def __post_init__(self) -> None:
        if self.samples < 20:
            raise ValueError(f"samples must be >= 20 per side for the chi-square approximation, got {self.samples}")
        if not 0 < self.level < self.power < 1:
            raise ValueError(f"level must be in (0, 1) and below the power, got {self.level}")
        if self.concurrency < 1 or self.timeout <= 0 or self.retries < 1:
            raise ValueError("concurrency and retries must be >= 1, and timeout > 0")
        if not self.max_tokens or min(self.max_tokens) < 1 or self.boundary_tokens < 0 or self.greedy_tokens < 0:
            raise ValueError("max_tokens must be >= 1 each; boundary and greedy tokens >= 0")
        if self.control_factor <= 0 or self.control_factor == 1:
            raise ValueError(f"the control's temperature factor must be > 0 and not 1, got {self.control_factor}")


def run_remote_audit(endpoint: Side, reference: Side, prompts: Sequence[Prompt], settings: Sequence[Setting],
                     config: RemoteConfig = RemoteConfig(), transport=None, progress: bool = True) -> RemoteReport:
    """Audit `endpoint` against `reference`. Ctrl-C ends the sampling and returns what it had
    (`interrupted`); an endpoint that cannot be audited raises EndpointError (one line)."""
    return asyncio.run(_audit(endpoint, reference, tuple(prompts), tuple(settings), config, transport, progress))


async def _audit(endpoint: Side, reference: Side, prompts: tuple[Prompt, ...], settings: tuple[Setting, ...],
                 config: RemoteConfig, transport, progress: bool) -> RemoteReport:
    t0 = time.perf_counter()
    client = Client(config.concurrency, config.timeout, transport, config.retries)
    try:
        endpoint, reference = await _with_model(client, endpoint), await _with_model(client, reference)
        caps = await probe(client, (endpoint, reference), prompts, settings, config.top_logprobs)
        prompts = tuple(p for p in prompts if p.chat in caps.kinds)
        settings = tuple(s for s in settings if not s.uses & caps.refused)
        if not settings:
            raise EndpointError("every sampling setting needs a field a server refused: " + "; ".join(caps.notes))
        run = _Run(client, caps, config, endpoint, reference, build_plan(prompts, settings, config.max_tokens,
                                                                         config.boundary_tokens),
                   prompts if config.greedy_tokens else ())
        run.bar = tqdm(total=run.report.planned, desc="audit", unit="req", disable=not progress)
        try:
            await run.sample_groups()
            await run.sample_control()
            await run.check_greedy()
        except asyncio.CancelledError:  # Ctrl-C: the report says what the run had
            asyncio.current_task().uncancel()
            run.report.interrupted = True
        except EndpointError as exc:
            raise EndpointError(f"{exc} (after {run.answered()} of {run.report.planned} requests)") from None
        finally:
            run.bar.close()
        report = run.finish()
    finally:
        await client.close()
    report.seconds = time.perf_counter() - t0
    return report


class _Run:
    """One audit's state: its plan, the answers so far, the report they go into."""

    def __init__(self, client: Client, caps: Capabilities, config: RemoteConfig, endpoint: Side, reference: Side,
                 plan: list[Group], greedy_prompts: tuple[Prompt, ...]) -> None:
        self.client, self.caps, self.config, self.plan, self.greedy_prompts = client, caps, config, plan, greedy_prompts
        self.endpoint, self.reference = endpoint, reference
        # each greedy check counts as a test too: its tie probe may call a divergence a loss
        tests = sum(len(statistics(g, caps.tokens.get(g.prompt.chat, False))) + _one_sample(g, caps)
                    for g in plan) + len(greedy_prompts)
        self.level = config.level / tests
        # the negative control's answers, by group (each prompt's first)
        self.control: dict[int, list[Answer]] = {i: [] for i in _control_groups(plan)}
        self.report = RemoteReport(_describe(endpoint), _describe(reference), config.level, config.power,
                                   config.samples, tests, notes=list(caps.notes),
                                   planned=(2 * len(plan) + len(self.control)) * config.samples
                                   + 2 * len(greedy_prompts))
        self.answers: dict[tuple[int, str], list[Answer]] = {(i, s.name): [] for i in range(len(plan))
                                                             for s in (endpoint, reference)}
        self.probes: list[list[Answer]] = []  # the tie probes' answers
        self.bar = None

    def answered(self) -> int:
        return (sum(map(len, self.answers.values())) + sum(map(len, self.control.values())) + 2 * len(self.report.greedy)
                + sum(map(len, self.probes)))

    async def sample_groups(self) -> None:
        """Every group's answers from both sides, interleaved; the drafts each side reports meanwhile."""
        sides = (self.endpoint, self.reference)
        jobs = [(side, _request(g, g.setting, self.caps), g.prompt.chat, self.answers[i, side.name])
                for _ in range(self.config.samples) for i, g in enumerate(self.plan) for side in sides]
        before = await _counters(self.client, sides)
        await _sample(self.client, jobs, self.config.concurrency, self.bar)
        self.report.drafts = _drafts(self.answers, sides, before, await _counters(self.client, sides))

    async def sample_control(self) -> None:
        """The reference at the perturbed temperature, on each prompt's first group, interleaved. A prompt
        whose answers barely move with the temperature (one likely answer, or a long flat tail that the cells
        merge) would hide the control: one of several prompts shows it where one chosen prompt may not."""
        jobs = [(self.reference, _request(self.plan[i], _perturbed(self.plan[i].setting, self.config.control_factor),
                                          self.caps), self.plan[i].prompt.chat, self.control[i])
                for _ in range(self.config.samples) for i in self.control]
        await _sample(self.client, jobs, self.config.concurrency, self.bar)

    async def check_greedy(self) -> None:
        config, needed = self.config, probe_answers(self.level)
        for prompt in self.greedy_prompts:
            request = {**prompt.fields(), "max_tokens": config.greedy_tokens, "temperature": 0.0,
                       **{k: v for k, v in self.caps.off.items() if v is not None},
                       **self.caps.logprobs.get(prompt.chat, {})}
            pair = [await self.client.complete(side, request, prompt.chat) for side in (self.endpoint, self.reference)]
            self.bar.update(2)
            check = greedy_check(f"{prompt.name}: greedy, {config.greedy_tokens} tokens", *pair, config.tie_margin)
            if check.result == "unexplained":  # no logprobs to tell: sample the reference just above greedy
                hot = probe_temperature(config.tie_margin)
                self.probes.append([])
                self.report.planned += 2 * needed
                self.bar.total = self.report.planned
                await _sample(self.client, [(self.reference, {**request, "temperature": hot}, prompt.chat,
                                             self.probes[-1])] * (2 * needed), config.concurrency, self.bar)
                check = tie_probe(check, *pair, self.probes[-1], needed, hot, config.tie_margin)
            self.report.greedy.append(check)

    def finish(self) -> RemoteReport:
        """The tests on the answers that arrived."""
        report, config = self.report, self.config
        report.sent, report.retried = self.answered(), self.client.retried
        report.notes += sorted(self.client.notes)
        if report.sent and not report.interrupted and "endpoint" not in report.drafts:
            report.notes.append("the endpoint reports no draft counts (no usage.specdecode in its answers, no "
                                "spec_decode counters at /metrics), so the audit cannot show that it speculated: a "
                                "pass says its law is the reference's, whatever it ran")
        for i, g in enumerate(self.plan):
            report.comparisons += _compare(g, self.answers[i, self.endpoint.name], self.answers[i, self.reference.name],
                                           self.caps, self.level, config.power)
        for i, answers in self.control.items():
            group = self.plan[i]
            if answers:
                hotter = _perturbed(group.setting, config.control_factor).temperature
                name = f"control (reference at T {hotter:g} vs T {group.setting.temperature:g}): {group.label}"
                report.controls += _compare(group, answers, self.answers[i, self.reference.name], self.caps,
                                            self.level, config.power, name)
        return report


async def _with_model(client: Client, side: Side) -> Side:
    """The side with its model (the first listed, unless given) and, where its body was left to the audit
    (None), the one it needs: on our server, the reference turns speculation off and the endpoint pins
    K (its adaptive K may draft nothing on answers this short); elsewhere the endpoint sends nothing
    more, and a reference must be told how to turn speculation off."""
    models = await client.models(side) if not side.model or side.body is None else []
    if not side.model and not models:
        raise EndpointError(f"{side.url}/models lists no model: give {model_option(side)}")
    if side.body is None:
        ours = any(m.get("owned_by") == "specdecode" for m in models)
        if side.name == "reference" and not ours:
            raise EndpointError(f"{side.url} is not a specdecode server, so the audit does not know how to turn its "
                                f"speculation off: give --reference URL (a deployment without speculation) or "
                                f"--reference-body JSON (the fields that turn it off per request)")
        side = replace(side, body=(SPECULATION_OFF if side.name == "reference" else SPECULATION_PINNED) if ours else {})
    return side if side.model else replace(side, model=models[0]["id"])


def _describe(side: Side) -> dict:
    return {"url": side.url, "model": side.model, "body": side.body}


def _one_sample(group: Group, caps: Capabilities) -> int:
    """1 if the group also gets the test against the reference's reported first-token law: at temperature 1
    without truncation only, where the model's raw logprobs (what vLLM and llama-server report by default)
    are the law sampled."""
    chat = group.prompt.chat
    return int(not group.boundary and group.setting == Setting(1.0) and caps.tokens.get(chat, False)
               and caps.top.get(chat, False))


def _request(group: Group, setting: Setting, caps: Capabilities) -> dict:
    request = {**group.prompt.fields(), "max_tokens": group.max_tokens, **caps.sampling_fields(setting),
               **caps.logprobs.get(group.prompt.chat, {})}
    if group.boundary and group.prompt.stop:
        request["stop"] = list(group.prompt.stop)
    return request


def _perturbed(setting: Setting, factor: float) -> Setting:
    """The control's setting: the temperature times `factor`, or divided by it where that would pass 2."""
    hotter = setting.scaled(factor)
    return hotter if hotter.temperature == setting.temperature * factor else setting.scaled(1 / factor)


async def _sample(client: Client, jobs: list[tuple[Side, dict, bool, list]], concurrency: int, bar) -> None:
    """Send the jobs (side, request, chat, where its answer goes), `concurrency` at a time, in order."""
    pending = iter(jobs)

    async def worker() -> None:
        for side, request, chat, sink in pending:  # one iterator shared by the workers: each job taken once
            sink.append(await client.complete(side, request, chat))
            bar.update()

    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    try:
        await asyncio.gather(*workers)
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)


def _control_groups(plan: list[Group]) -> list[int]:
    """The control's groups: each prompt's first short group (its first setting and max_tokens)."""
    first: dict[Prompt, int] = {}
    for i, g in enumerate(plan):
        if not g.boundary:
            first.setdefault(g.prompt, i)
    return list(first.values())


def _compare(group: Group, e: list[Answer], r: list[Answer], caps: Capabilities, level: float, power: float,
             name: str | None = None) -> list[Comparison]:
    """The group's tests of answers `e` against the reference's answers `r`."""
    name = name or group.label
    out = []
    for stat in statistics(group, caps.tokens.get(group.prompt.chat, False)):
        a, b = [stat.of(x) for x in e], [stat.of(x) for x in r]
        a, b = [x for x in a if x is not None], [x for x in b if x is not None]
        out.append(two_sample(name, stat.name, a, b, level, power))
    if _one_sample(group, caps):
        first = lambda answers: [a.tokens[0] if a.tokens else END for a in answers if a.tokens is not None]  # noqa: E731
        out.append(against_law(name, first(e), first(r), first_token_law(r), level, power))
    return out


async def _counters(client: Client, sides: tuple[Side, Side]) -> dict:
    """Each side's Prometheus draft counters, where each side is its own server (at one URL they do not
    say which side drafted)."""
    if sides[0].url == sides[1].url:
        return {}
    return {side.name: await client.draft_counters(side) for side in sides}


def _drafts(answers: dict, sides: tuple[Side, Side], before: dict, after: dict) -> dict:
    """Drafts proposed and accepted on each side during the sampling, where the server says (our usage
    extension per answer, else its /metrics counters): evidence that the endpoint speculated and the
    reference did not."""
    out = {}
    for side in sides:
        mine = [a for (_, name), those in answers.items() if name == side.name for a in those]
        counted = [a for a in mine if a.drafted is not None]
        if counted:
            out[side.name] = {"drafted": sum(a.drafted for a in counted), "accepted": sum(a.accepted or 0 for a in counted),
                              "answers": len(counted), "source": "usage.specdecode"}
        elif before.get(side.name) is not None and after.get(side.name) is not None:
            (d0, a0), (d1, a1) = before[side.name], after[side.name]
            out[side.name] = {"drafted": int(d1 - d0), "accepted": int(a1 - a0), "answers": len(mine),
                              "source": "/metrics"}
    return out
