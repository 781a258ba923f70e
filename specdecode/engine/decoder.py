"""Text in, text out: the engine with a tokenizer, chat templates and the models loaded by name.

`SpeculativeDecoder` is the engine (engine/engine.py) over a target, its drafters and their
tokenizer: `generate`/`stream` add one request and step it to its end, `generate_many`/
`stream_many` add several, decoded as one batch (up to `max_batch` at once: each a slot, a sequence
of the target with its own cache and drafters, all verified in one pass per round).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from transformers import PreTrainedTokenizerBase

from specdecode.backends.protocol import Model
from specdecode.checks import SettingError, check_utf8, integer
from specdecode.core.probs import SamplingParams
from specdecode.drafters.protocol import Drafter
from specdecode.engine.calibration import CalibrationStore
from specdecode.engine.config import GenerationConfig
from specdecode.engine.engine import Engine, check_request, check_stats
from specdecode.engine.loading import eos_ids as end_ids, load
from specdecode.engine.policy import AdaptiveK, batch_pass_sizes
from specdecode.engine.scheduler import SchedulerConfig
from specdecode.engine.slot import Slot
from specdecode.engine.stats import GenerationStats
from specdecode.engine.text import Chunk

Prompt = str | Sequence[dict]  # plain text, or chat messages [{"role": ..., "content": ...}]


@dataclass
class Generation:
    text: str
    tokens: list[int]
    stats: GenerationStats
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason

    @staticmethod
    def of(chunks: list[Chunk], stats: GenerationStats) -> "Generation":
        return Generation("".join(c.text for c in chunks), [t for c in chunks for t in c.tokens], stats, chunks)


class SpeculativeDecoder(Engine):
    """A target model, drafters tried in order, and a tokenizer: generate text speculatively.

    Build it once (loading models is the slow part) and call `generate`/`stream` per request,
    or `generate_many`/`stream_many` for several prompts decoded as one batch. With
    GenerationConfig(k=None) the decoder's AdaptiveK chooses K each round from costs measured once
    per machine (cached, see `calibrate`) and the request's own acceptance, so a seed reproduces its
    sample in any process that uses the same models, backend, settings and calibration file; a
    recalibration or another machine may change K and with it the sample (never its law).
    """

    def __init__(self, target: Model, tokenizer: PreTrainedTokenizerBase | None, drafters: Sequence[Drafter] = (),
                 eos_ids: Iterable[int] | None = None, policy: AdaptiveK | None = None,
                 calibration: CalibrationStore | None = None, recalibrate: bool = False,
                 max_batch: int = 1, scheduling: SchedulerConfig = SchedulerConfig()) -> None:
        if integer(max_batch) is None or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        drafters = tuple(drafters)
        # slot 0 is (target, drafters); the others are their siblings (one cache each)
        slots = [Slot(target, drafters)] + [Slot(target.sibling(), tuple(d.fork() for d in drafters))
                                            for _ in range(max_batch - 1)]
        policy = policy if policy is not None else AdaptiveK()
        if max_batch > 1 and not policy.batch_sizes:  # a batch's pass holds many rows: measure big passes
            policy.batch_sizes = batch_pass_sizes(max_batch, policy.k_max)
        super().__init__(slots, end_ids(tokenizer, target) if eos_ids is None else eos_ids, policy, tokenizer,
                         calibration, recalibrate, scheduling)

    @classmethod
    def load(cls, target: str | None = None, draft: str | None = None, *, drafter: str = "auto",
             backend: str = "auto", dtype: str = "auto", device: str = "auto", draft_int8: bool | None = None,
             draft_vocab: int | None = None, draft_confidence: float = 0.0, speculative: bool = True,
             threads: int = 0, n_ctx: int = 0, recalibrate: bool = False, max_batch: int = 1,
             tree: int = 0, progress: bool = True,
             scheduling: SchedulerConfig = SchedulerConfig()) -> "SpeculativeDecoder":
        """Load target and draft: None = the embedded pair; else a model directory or a .gguf file.

        backend: "native" (our kernels, GGUF files, CPU), "llama.cpp" (GGUF files, CPU), "transformers",
        or "auto" (native for GGUF on CPU, llama.cpp where the CPU cannot run it, else transformers). Both models run on the target's backend: two engines' thread
        pools in one process slow each other down.
        drafter: "model" (draft model), "lookup" (prompt lookup, no draft model), "suffix" (the latest
        continuation in the request's text, else in earlier requests' texts, its length set by how often
        the text continued that way; no draft model),
        or "auto" (lookup when it finds a match, else the draft model; with a tree, the draft model's
        tree with lookup's continuations as copies, else lookup: `drafters.auto_drafters`).
        dtype: transformers only (llama.cpp runs the GGUF's own quantised weights).
        draft_int8 / draft_vocab: make a transformers draft cheaper (exactness is unaffected; see
        backends/cheap.py). None = the measured default for the device.
        draft_confidence: stop a draft early when the draft's top probability falls below it
        (0 = off; speed only, the output law is unchanged).
        tree: up to this many extra draft-tree nodes per round (alternative candidates where the draft
        is unsure, or the suffix drafter's other continuations, verified exactly by the multi-candidate
        rule, core/tree.py); adaptive K keeps only those its cost model says pay. 0 = chains. Needs
        drafter model, auto (the draft model's tree, with prompt lookup's continuations of its
        paths as copies) or suffix.
        threads / n_ctx: llama.cpp only (0 = the machine's cores / the model's context; with
        max_batch > 1 the context of each sequence, by default 32768 tokens shared out).
        max_batch: sequences decoded at once by `generate_many`/`stream_many` and the server
        (0 = auto: DEFAULT_MAX_BATCH on the GGUF backends, 1 on transformers, whose sequences of a batch
        run one pass each).
        recalibrate: measure adaptive K's costs anew instead of reading them from the cache
        directory, where they are kept per machine, model, backend and drafter.
        scheduling: how requests share the batch (engine/scheduler.py; the server's worker sets its own).
        """
        from specdecode.backends.weights import cache_dir

        loaded = load(target, draft, drafter=drafter, backend=backend, dtype=dtype, device=device,
                      draft_int8=draft_int8, draft_vocab=draft_vocab, draft_confidence=draft_confidence,
                      speculative=speculative, threads=threads, n_ctx=n_ctx, max_batch=max_batch, tree=tree,
                      progress=progress)
        return cls(loaded.target, loaded.tokenizer, loaded.drafters, calibration=CalibrationStore(
            cache_dir() / "calibration"), recalibrate=recalibrate, max_batch=loaded.max_batch, scheduling=scheduling)

    def encode(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt. Messages always use the chat template; text does when chat=True."""
        _check_prompt(prompt)
        if chat is not None and not isinstance(chat, bool):
            raise TypeError(f"chat must be True, False or None, got {chat!r}")
        if isinstance(prompt, str):
            if not chat:
                return _some_tokens(list(self.tokenizer.encode(prompt)))
            prompt = [{"role": "user", "content": prompt}]
        if self.tokenizer.chat_template is None:
            raise SettingError("this tokenizer has no chat template; pass plain text without {chat}")
        ids = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, Mapping):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        return _some_tokens(list(ids))

    def stream(self, prompt: Prompt, config: GenerationConfig = GenerationConfig(), *, chat: bool | None = None,
               speculative: bool = True, stats: GenerationStats | None = None) -> Iterator[Chunk]:
        """Yield text as rounds are emitted. `stats` (optional) is filled in as it goes."""
        return self.stream_ids(self.encode(prompt, chat), config, speculative=speculative, stats=stats)

    def stream_ids(self, ids: Sequence[int], config: GenerationConfig = GenerationConfig(), *,
                   speculative: bool = True, stats: GenerationStats | None = None) -> Iterator[Chunk]:
        """`stream` for a prompt that is already token ids."""
        yield from self.follow(self.add_request(ids, config, speculative=speculative, stats=stats, text=True))

    def generate(self, prompt: Prompt, config: GenerationConfig = GenerationConfig(), *,
                 chat: bool | None = None, speculative: bool = True) -> Generation:
        stats = GenerationStats()
        return Generation.of(list(self.stream(prompt, config, chat=chat, speculative=speculative, stats=stats)), stats)

    def generate_many(self, prompts: Sequence[Prompt], configs: GenerationConfig | Sequence[GenerationConfig]
                      = GenerationConfig(), *, chat: bool | None = None,
                      speculative: bool = True) -> list[Generation]:
        """Generate for several prompts as one batch (each with its own config, or one for all);
        results in the prompts' order. Each output has the law it has alone."""
        ids, configs = self._requests(prompts, configs, chat, speculative)
        stats = [GenerationStats() for _ in ids]
        chunks: list[list[Chunk]] = [[] for _ in ids]
        for i, chunk in self._batch(ids, configs, speculative, stats):
            chunks[i].append(chunk)
        return [Generation.of(c, s) for c, s in zip(chunks, stats)]

    def stream_many(self, prompts: Sequence[Prompt], configs: GenerationConfig | Sequence[GenerationConfig]
                    = GenerationConfig(), *, chat: bool | None = None, speculative: bool = True,
                    stats: Sequence[GenerationStats] | None = None) -> Iterator[tuple[int, Chunk]]:
        """Stream several prompts decoded as one batch: (prompt index, chunk) as rounds end;
        each prompt's chunks arrive in order. `stats` (optional): one per prompt, filled in. A failure
        is raised (every generation stops there)."""
        ids, configs = self._requests(prompts, configs, chat, speculative)
        stats = list(stats) if stats is not None else [GenerationStats() for _ in ids]
        if len(stats) != len(ids):
            raise ValueError(f"got {len(ids)} prompts but {len(stats)} stats objects")
        for s in stats:
            check_stats(s)
        return self._batch(ids, configs, speculative, stats)

    def _batch(self, ids: list[list[int]], configs: list[GenerationConfig], speculative: bool,
               stats: list[GenerationStats]) -> Iterator[tuple[int, Chunk]]:
        """The requests added together (waiting where no slot is free) and stepped to their ends."""
        for i, prompt in enumerate(ids):  # refused up front, not after others have run
            if len(prompt) + 1 > self.target.max_length:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens; the context holds {self.target.max_length}: "
                                 f"give 1 to {self.target.max_length - 1} tokens")
        requests = []
        try:
            for i, (prompt, config, s) in enumerate(zip(ids, configs, stats)):
                requests.append(self.add_request(prompt, config, key=i, speculative=speculative, stats=s, text=True))
            mine = set(map(id, requests))
            while any(not r.finished for r in requests):
                for request in self.step():
                    if id(request) in mine:
                        for chunk in request.take():
                            yield request.key, chunk
        finally:
            for request in requests:
                self.abort(request)

    def _requests(self, prompts, configs, chat, speculative) -> tuple[list[list[int]], list[GenerationConfig]]:
        if isinstance(prompts, (str, dict, bytes, bytearray)) or not isinstance(prompts, Sequence):
            raise ValueError("generate_many/stream_many take a list of prompts (for one prompt use generate/stream)")
        if isinstance(configs, GenerationConfig):
            configs = [configs] * len(prompts)
        if isinstance(configs, (str, bytes, dict)) or not isinstance(configs, Iterable):
            raise TypeError(f"configs must be a GenerationConfig or one per prompt, got {type(configs).__name__}")
        configs = list(configs)
        for config in configs:
            check_request(config, speculative)
        if len(configs) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(configs)} configs: give one config per prompt "
                             f"or one for all")
        return [self.encode(p, chat) for p in prompts], configs


def generate(prompt: Prompt, target: str | None = None, draft: str | None = None, *, k: int | None = None,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = 128,
             seed: int = 0, stop: Sequence[str] = (), chat: bool | None = None, speculative: bool = True,
             backend: str = "auto", dtype: str = "auto", device: str = "auto") -> Generation:
    """One call: load the pair (None = embedded) and generate; k=None is adaptive K.
    For many calls, build a SpeculativeDecoder once."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, k=k, seed=seed, stop=stop,
                              sampling=SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k))
    decoder = SpeculativeDecoder.load(target, draft, backend=backend, dtype=dtype, device=device,
                                      speculative=speculative)
    return decoder.generate(prompt, config, chat=chat, speculative=speculative)


def _check_prompt(prompt) -> None:
    """A prompt is non-empty text or a non-empty list of messages {"role": str, "content": str}, all of
    it valid Unicode: anything else would fail deep in the tokenizer with a message about its types."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        check_utf8(prompt, "the prompt")
        return
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, (list, tuple)):
        raise TypeError(f"a prompt is text (str) or a list of chat messages, got {type(prompt).__name__}; for "
                        f"token ids use stream_ids() or generate_ids()")
    if not prompt:
        raise ValueError("the prompt is an empty list of messages")
    for i, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise TypeError(f"message {i} must be a dict with a string 'role' and a string 'content', "
                            f"got {message!r}"[:300])
        check_utf8(message["content"], f"message {i}'s content")


def _some_tokens(ids: list[int]) -> list[int]:
    if not ids:
        raise ValueError("the prompt gives no tokens with this model's tokenizer (it drops every character "
                         "of it): give text the tokenizer keeps")
    return ids
