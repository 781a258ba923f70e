"""The generation methods a benchmark compares, each behind one call signature.

Ours share one target backend (one cache, used by one method at a time). Hugging
Face's run `model.generate` on the very same target weights, with the plain
(unmodified) draft as `assistant_model`, so "same models, same dtype" holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from specdecode.backends.hf import HFModel
from specdecode.core.probs import SamplingParams
from specdecode.drafters.lookup import LookupDrafter
from specdecode.drafters.model import ModelDrafter
from specdecode.engine.config import GenerationConfig
from specdecode.engine.decoder import SpeculativeDecoder
from specdecode.engine.policy import AdaptiveK
from specdecode.engine.stats import GenerationStats

BASELINE = "plain"


@dataclass(frozen=True, slots=True)
class RunResult:
    tokens: list[int]
    seconds: float  # wall time of the whole call (prefill included, for every method alike)
    stats: GenerationStats | None  # ours only


Runner = Callable[[list[int], SamplingParams, int, int], RunResult]  # (prompt ids, sampling, seed, max_new)


@dataclass(frozen=True, slots=True)
class Method:
    name: str
    family: str  # "ours" or "hf"
    k: int | None  # fixed K, or None (adaptive / not applicable)
    run: Runner


def our_methods(target: HFModel, tokenizer, cheap_draft: HFModel | None, plain_draft: HFModel | None,
                k_sweep: list[int], eos_ids: frozenset[int]) -> list[Method]:
    def make(name: str, drafters, k: int | None) -> Method:
        decoder = SpeculativeDecoder(target, tokenizer, drafters, eos_ids=eos_ids, policy=AdaptiveK())

        def run(ids: list[int], sampling: SamplingParams, seed: int, max_new: int) -> RunResult:
            config = GenerationConfig(max_new_tokens=max_new, sampling=sampling, k=k, seed=seed)
            stats = GenerationStats()
            t0 = time.perf_counter()
            tokens = decoder.generate_ids(ids, config, stats=stats, speculative=bool(drafters))
            return RunResult(tokens, time.perf_counter() - t0, stats)

        return Method(name, "ours", k, run)

    methods = [make(BASELINE, [], 1)]
    if cheap_draft is not None:
        model = ModelDrafter(cheap_draft)
        methods += [make(f"model K={k}", [model], k) for k in k_sweep]
        methods.append(make("model adaptive", [model], None))
        methods.append(make("auto adaptive", [LookupDrafter(), model], None))
    if plain_draft is not None:
        methods.append(make("model adaptive, plain draft", [ModelDrafter(plain_draft)], None))
    methods.append(make("lookup adaptive", [LookupDrafter()], None))
    return methods


def hf_methods(target: HFModel, plain_draft: HFModel | None, eos_ids: frozenset[int],
               pad_id: int | None) -> list[Method]:
    def make(name: str, **extra) -> Method:
        def run(ids: list[int], sampling: SamplingParams, seed: int, max_new: int) -> RunResult:
            torch.manual_seed(seed)  # HF samples from the global RNG; this is its only interface
            kwargs = dict(max_new_tokens=max_new, min_new_tokens=0, eos_token_id=sorted(eos_ids),
                          pad_token_id=pad_id if pad_id is not None else sorted(eos_ids)[0])
            if sampling.greedy:
                kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
            else:
                kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None,
                              top_p=sampling.top_p)
            inputs = torch.tensor([ids], device=target.device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = target.model.generate(inputs, attention_mask=torch.ones_like(inputs), **kwargs, **extra)
            seconds = time.perf_counter() - t0
            return RunResult(out[0, len(ids):].tolist(), seconds, None)

        return Method(name, "hf", None, run)

    methods = [make("hf plain")]
    if plain_draft is not None:
        methods.append(make("hf assisted", assistant_model=plain_draft.model))
    methods.append(make("hf prompt-lookup", prompt_lookup_num_tokens=10))
    return methods
