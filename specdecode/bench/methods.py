"""The generation methods a benchmark compares, each behind one call signature.

Ours share one target backend (one cache, used by one method at a time). Hugging
Face's run `model.generate` on the very same target weights, with the plain
(unmodified) draft as `assistant_model`, so "same models, same dtype" holds.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import torch

from specdecode.backends.hf import HFModel
from specdecode.core.probs import SamplingParams
from specdecode.drafters import auto_drafters
from specdecode.drafters.lookup import LookupDrafter
from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.suffix import SuffixConfig, SuffixDrafter
from specdecode.engine.config import GenerationConfig
from specdecode.engine.decoder import SpeculativeDecoder
from specdecode.engine.policy import AdaptiveK
from specdecode.engine.stats import GenerationStats

BASELINE = "plain"
PLAIN_DECODERS = (BASELINE, "llama.cpp plain", "hf plain")  # the plain decoders a run may measure
# how every method's name starts (Method checks it): `bench --methods` checks its prefixes against
# these before the models load, a minute before the methods themselves exist
FAMILIES = (BASELINE, "model ", "auto ", "lookup ", "suffix ", "hf ", "llama.cpp ")


@dataclass(frozen=True, slots=True)
class RunResult:
    tokens: list[int]
    seconds: float  # wall time of the whole call (prefill included, for every method alike)
    stats: GenerationStats | None  # ours only
    # when the first tokens came out (the prefill and the first pass) and how many: the decode rate
    # after that point does not depend on how long the output is (None: the method cannot tell)
    t_first: float | None = None
    n_first: int = 1

    @property
    def decode_tokens_per_second(self) -> float | None:
        if self.t_first is None or len(self.tokens) <= self.n_first or self.seconds <= self.t_first:
            return None
        return (len(self.tokens) - self.n_first) / (self.seconds - self.t_first)


Runner = Callable[[list[int], SamplingParams, int, int], RunResult]  # (prompt ids, sampling, seed, max_new)


@dataclass(frozen=True, slots=True)
class Method:
    name: str
    family: str  # "ours" or "hf"
    k: int | None  # fixed K, or None (adaptive / not applicable)
    run: Runner

    def __post_init__(self) -> None:
        if not self.name.startswith(FAMILIES):
            raise ValueError(f"method {self.name!r} starts with none of FAMILIES {FAMILIES}: add its first word")


# The bench's suffix drafter counts the request's own text only. Its prompts are unrelated, so a history
# across them would hold little but the earlier repetitions of the same prompt, which it would then copy
# (each cell runs a prompt `reps` times); benchmarks/session.py and repeat.py measure the history.
REQUEST_ONLY = SuffixConfig(history_tokens=0)


def our_methods(target: HFModel, tokenizer, cheap_draft: HFModel | None, plain_draft: HFModel | None,
                k_sweep: list[int], eos_ids: frozenset[int], verifications: tuple[str, ...] = ("token",),
                trees: tuple[int, ...] = ()) -> list[Method]:
    """Plain decoding, then our speculative methods with the first verification rule; each further
    rule adds the adaptive methods again, named "<method> (<rule>)"; each tree size adds the draft
    model's and the suffix drafter's methods with that tree, named "<method>, tree <n>"."""
    def make(name: str, drafters, k: int | None, verification: str = verifications[0]) -> Method:
        decoder = SpeculativeDecoder(target, tokenizer, drafters, eos_ids=eos_ids, policy=AdaptiveK())

        def run(ids: list[int], sampling: SamplingParams, seed: int, max_new: int) -> RunResult:
            config = GenerationConfig(max_new_tokens=max_new, sampling=sampling, k=k, seed=seed,
                                      verification=verification)
            stats = GenerationStats()
            t0 = time.perf_counter()
            tokens = decoder.generate_ids(ids, config, stats=stats, speculative=bool(drafters))
            seconds = time.perf_counter() - t0
            first = stats.rounds[0] if stats.rounds else None
            t_first = stats.t_prefill + first.t_draft + first.t_verify if first else None
            return RunResult(tokens, seconds, stats, t_first, first.emitted if first else 1)

        return Method(name, "ours", k, run)

    methods = [make(BASELINE, [], 1)]
    if cheap_draft is not None:
        model = ModelDrafter(cheap_draft)
        methods += [make(f"model K={k}", [model], k) for k in k_sweep]
        methods.append(make("model adaptive", [model], None))
        methods.append(make("auto adaptive", auto_drafters(cheap_draft), None))
    if plain_draft is not None:
        methods.append(make("model adaptive, plain draft", [ModelDrafter(plain_draft)], None))
    methods.append(make("lookup adaptive", [LookupDrafter()], None))
    methods.append(make("suffix adaptive", [SuffixDrafter(REQUEST_ONLY)], None))
    for n in trees:  # draft trees: the chain of K plus up to n extra nodes (all kept at a fixed K)
        methods.append(make(f"suffix adaptive, tree {n}", [SuffixDrafter(REQUEST_ONLY, tree=n)], None))
        if cheap_draft is not None:
            tree_model = ModelDrafter(cheap_draft, tree=n)
            methods += [make(f"model K={k}, tree {n}", [tree_model], k) for k in k_sweep]
            # auto's tree: the draft model's, with prompt lookup's continuations as copies
            methods += [make(f"auto K={k}, tree {n}", auto_drafters(cheap_draft, n), k) for k in k_sweep]
            methods.append(make(f"model adaptive, tree {n}", [tree_model], None))
            methods.append(make(f"auto adaptive, tree {n}", auto_drafters(cheap_draft, n), None))
    for rule in verifications[1:]:
        if cheap_draft is not None:
            methods.append(make(f"model adaptive ({rule})", [ModelDrafter(cheap_draft)], None, rule))
            methods.append(make(f"auto adaptive ({rule})", auto_drafters(cheap_draft), None, rule))
        methods.append(make(f"lookup adaptive ({rule})", [LookupDrafter()], None, rule))
        methods.append(make(f"suffix adaptive ({rule})", [SuffixDrafter(REQUEST_ONLY)], None, rule))
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


# --- builders: each runs inside its own benchmark process (bench/workers.py) and loads its models ---

def build_ours(target: str | None, draft: str | None, backend: str, dtype: str, device: str, threads: int,
               n_ctx: int, k_sweep: list[int], with_hf: bool, curve_ids: list[int],
               curve_max: int, verifications: tuple[str, ...] = ("token",),
               trees: tuple[int, ...] = ()) -> tuple[list[Method], dict]:
    """Our methods on `backend` (and, on the transformers backend, HF generate on the same weights);
    info: the target's measured cost curve after `curve_ids`, names, the EOS ids and dtype."""
    import copy

    from specdecode.backends.hf import HFModel, resolve_device, resolve_dtype
    from specdecode.backends.llamacpp import LlamaSettings
    from specdecode.backends.weights import load_model
    from specdecode.engine.calibration import measure_cost_curve
    from specdecode.engine.loading import check_compatible, make_cheaper

    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    settings = LlamaSettings(n_threads=threads, n_ctx=n_ctx, tree_leaves=max(trees, default=-1) + 1)
    target_model, tokenizer = load_model(target, "target", torch_dtype, device, progress=False, backend=backend,
                                         llama_settings=settings)
    draft_model, draft_tok = load_model(draft, "draft", torch_dtype, device, progress=False, backend=backend,
                                        llama_settings=settings)
    check_compatible(target_model, tokenizer, draft_model, draft_tok)
    eos_ids = SpeculativeDecoder(target_model, tokenizer).eos_ids
    info = {"target": target_model.name, "draft": draft_model.name, "eos_ids": sorted(eos_ids),
            "dtype": str(torch_dtype).replace("torch.", "") if backend == "transformers" else "gguf",
            "exact": backend == "transformers" and torch_dtype in (torch.float32, torch.float64),
            "cost_curve": measure_cost_curve(target_model, curve_ids, curve_max)}
    if backend != "transformers":  # the draft runs its GGUF as it is: no cheaper variant to compare
        return our_methods(target_model, tokenizer, draft_model, None, k_sweep, eos_ids, verifications,
                           trees), info
    cheap = HFModel(copy.deepcopy(draft_model.model), f"{draft_model.name} (cheap: CPU defaults)")
    make_cheaper(cheap, tokenizer, device, None, None)
    methods = our_methods(target_model, tokenizer, cheap, draft_model, k_sweep, eos_ids, verifications, trees)
    if with_hf:
        methods += hf_methods(target_model, draft_model, eos_ids, tokenizer.pad_token_id)
    return methods, info


@contextlib.contextmanager
def same_weight_buffers():
    """`Llama(...)` loads its weights as our backend does: without llama.cpp's extra buffer types in
    a build with AMX (`backends.llamacpp.amx_build`: its AMX path crashed the process). Llama takes no
    such option, so the defaults it asks llama.cpp for are adjusted while it loads (this process only
    runs llama.cpp's methods)."""
    from llama_cpp import llama_cpp as ll

    from specdecode.backends.llamacpp import amx_build

    defaults = ll.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = not amx_build(ll)
        return p
    ll.llama_model_default_params = params
    try:
        yield
    finally:
        ll.llama_model_default_params = defaults


def build_llamacpp_native(target: str | None, threads: int, n_ctx: int,
                          eos_ids: list[int]) -> tuple[list[Method], dict]:
    """llama.cpp's own decoding of the same GGUF (llama-cpp-python's `Llama.generate`): plain, and
    its prompt-lookup speculative decoding. Peers measured side by side, not our code."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from specdecode.backends.cpu import default_threads
    from specdecode.backends.weights import EMBEDDED, ensure_gguf, is_embedded

    path = str(ensure_gguf(EMBEDDED["target"], progress=False) if is_embedded(target) else target)
    threads = threads or default_threads()

    def make(name: str, **extra) -> Method:
        with same_weight_buffers():
            llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                        verbose=False, **extra)

        def run(ids: list[int], sampling: SamplingParams, seed: int, max_new: int) -> RunResult:
            llm.reset()  # no KV reuse across runs: every method prefills its prompt
            llm.set_seed(seed)
            temp = 0.0 if sampling.greedy else sampling.temperature
            out: list[int] = []
            t0 = time.perf_counter()
            t_first = None
            for tok in llm.generate(ids, temp=temp, top_k=sampling.top_k, top_p=sampling.top_p,
                                    min_p=sampling.min_p, typical_p=1.0, repeat_penalty=1.0, reset=True):
                out.append(int(tok))
                t_first = t_first if t_first is not None else time.perf_counter() - t0
                if tok in eos_ids or len(out) >= max_new:
                    break
            return RunResult(out, time.perf_counter() - t0, None, t_first)

        return Method(name, "llama.cpp", None, run)

    return [make("llama.cpp plain"),
            make("llama.cpp prompt-lookup", draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))], \
        {"threads": threads}
