"""CUDA check: exactness and greedy identity of speculative decoding on a GPU.

    python benchmarks/gpu_check.py [--device cuda]      (from the repository root; ~1 minute)

Self-contained (tiny random models from tests/tiny.py, nothing downloaded). Checks, on the device:
1. greedy identity: speculative output == plain greedy output, token for token (float64 and
   float32 tiny pairs, K = 1..4, several prompts), with chains and with draft trees (the tree
   pass's 4D mask and the cache compaction on the device; with prompt lookup's copies);
2. device independence: a sampled speculative generation (float64) on the device emits the
   same tokens as on the CPU for the same seed (randomness is drawn on the CPU generator);
3. exactness: the first two tokens of N sampled speculative generations (K = 2, budget 3) vs
   the target's exact joint, chi-square, false-failure probability 1e-3 (fixed seeds); and a
   negative control (a drafter reporting a wrong q) that must fail it.
Needs the transformers version pyproject.toml asks for (an accelerator image may ship an older
one, with which every check fails on the cache's length, not on the GPU; the script refuses it
up front). Where pip cannot reach an index, carry transformers and its missing dependencies as
wheels and put them first on PYTHONPATH. Measured on an NVIDIA H200 (torch 2.11+cu130,
transformers 5.25 carried): all pass, 76 s.
Exits 1 on any failure, 0 when all pass. tests/engine/test_cuda.py runs the same checks under
pytest (skipped where CUDA is unavailable).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: specdecode, tests

import torch  # noqa: E402

from specdecode.backends.hf import HFModel  # noqa: E402
from specdecode.core.probs import GREEDY, SamplingParams  # noqa: E402
from specdecode.drafters.lookup import LookupDrafter  # noqa: E402
from specdecode.drafters.model import ModelDrafter  # noqa: E402
from specdecode.drafters.protocol import Proposal  # noqa: E402
from specdecode.engine.config import GenerationConfig  # noqa: E402
from specdecode.engine.engine import generate_tokens  # noqa: E402
from specdecode.engine.stats import GenerationStats  # noqa: E402
from specdecode.stats import chi_square  # noqa: E402
from tests.engine.test_sampling_exact import PROMPT, V, exact_joint  # noqa: E402  (one definition of the law)
from tests.tiny import tiny_pair  # noqa: E402

P_THRESHOLD = 1e-3


def pair_on(device: str, dtype: torch.dtype, vocab: int, seed: int, noise: float, scale: float):
    target, draft = tiny_pair(vocab=vocab, seed=seed, noise=noise, dtype=dtype, scale=scale)
    return HFModel(target.model.to(device), "target"), HFModel(draft.model.to(device), "draft")


def tokens_of(target, drafters, prompt, config, stats=None) -> list[int]:
    return [t for r in generate_tokens(target, drafters, prompt, config, frozenset(), stats) for t in r.tokens]


def check_greedy_identity(device: str, dtype: torch.dtype, tree: int = 0) -> None:
    target, draft = pair_on(device, dtype, vocab=64, seed=1, noise=0.1, scale=0.6)
    g = torch.Generator().manual_seed(0)
    accepted = 0
    for k in range(1, 5):
        for _ in range(3):
            prompt = torch.randint(1, 64, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
            config = GenerationConfig(max_new_tokens=24, sampling=GREEDY, k=k)
            plain = tokens_of(target, [], prompt, config)
            stats = GenerationStats()
            drafter = ModelDrafter(draft, tree=tree, branches=LookupDrafter() if tree else None)  # trees with copies
            spec = tokens_of(target, [drafter], prompt, config, stats)
            if spec != plain:
                raise AssertionError(f"greedy identity failed on {device} {dtype} k={k}: {spec} != {plain}")
            accepted += stats.accepted
            accepted += stats.off_chain_rounds if tree else 0
    if accepted == 0:
        raise AssertionError("no draft was ever accepted: multi-token rounds were not exercised")


def check_same_sample_as_cpu(device: str) -> None:
    config = GenerationConfig(max_new_tokens=20, sampling=SamplingParams(temperature=0.9), k=3, seed=11)
    out = {}
    for where in ("cpu", device):
        target, draft = pair_on(where, torch.float64, vocab=64, seed=1, noise=0.1, scale=0.3)
        out[where] = tokens_of(target, [ModelDrafter(draft)], [5, 6, 7], config)
    if out["cpu"] != out[device]:
        raise AssertionError(f"seed 11 gives {out[device]} on {device} but {out['cpu']} on the CPU")


class WrongQDrafter(ModelDrafter):
    """Negative control: reports q with its mass moved (not the distribution it sampled from)."""

    def drafting(self, context, k, params, generator):  # what the loop runs (propose drives it too)
        proposal = yield from super().drafting(context, k, params, generator)
        q = proposal.q.roll(1, dims=-1)
        return Proposal(proposal.tokens, q, proposal.step_seconds)


def exactness_p_value(device: str, drafter_cls=ModelDrafter, n: int = 1500) -> float:
    target, draft = pair_on(device, torch.float64, vocab=V, seed=7, noise=0.1, scale=0.2)
    params = SamplingParams(temperature=0.7, top_k=3)
    drafters = [drafter_cls(draft)]
    counts = {key: 0 for key in itertools.product(range(V), repeat=2)}
    k2 = 0
    for seed in range(n):
        config = GenerationConfig(max_new_tokens=3, sampling=params, k=2, seed=seed)
        stats = GenerationStats()
        rounds = generate_tokens(target, drafters, PROMPT, config, frozenset(), stats)
        tokens: list[int] = []
        for r in rounds:
            tokens += r.tokens
            if len(tokens) >= 2:
                rounds.close()
                break
        counts[tuple(tokens[:2])] += 1
        k2 += stats.rounds[0].drafted == 2
    if k2 < n // 2:
        raise AssertionError(f"K = 2 was drafted in only {k2} of {n} first rounds")
    joint = exact_joint(target, params)
    keys = sorted(joint)
    return chi_square([counts[key] for key in keys], [joint[key] for key in keys]).p_value


def check_exactness(device: str) -> None:
    p_value = exactness_p_value(device)
    if p_value <= P_THRESHOLD:
        raise AssertionError(f"exactness: p = {p_value:.2e} <= {P_THRESHOLD} on {device}")
    control = exactness_p_value(device, WrongQDrafter)
    if control > P_THRESHOLD:
        raise AssertionError(f"negative control not caught on {device}: p = {control:.2e}")


CHECKS = {
    "greedy identity float64": lambda d: check_greedy_identity(d, torch.float64),
    "greedy identity float32": lambda d: check_greedy_identity(d, torch.float32),
    "greedy identity float32, draft trees": lambda d: check_greedy_identity(d, torch.float32, tree=4),
    "same sample as on the CPU": check_same_sample_as_cpu,
    "exactness (chi-square) + negative control": check_exactness,
}


def _old_transformers() -> str | None:
    """Why this machine's transformers is outside pyproject.toml's range, or None."""
    import tomllib

    import transformers
    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    wanted = next(r for r in map(Requirement, project["dependencies"]) if r.name == "transformers")
    if transformers.__version__ in wanted.specifier:
        return None
    return (f"transformers {transformers.__version__} is installed, pyproject.toml asks for {wanted}: install that "
            f"(or carry its wheel and put it first on PYTHONPATH)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available on this machine", file=sys.stderr)
        return 2
    if (problem := _old_transformers()) is not None:
        print(problem, file=sys.stderr)
        return 2
    failed = 0
    for name, check in CHECKS.items():
        t0 = time.perf_counter()
        try:
            check(args.device)
            print(f"PASS  {name}  ({time.perf_counter() - t0:.1f}s)")
        except Exception as exc:  # report every check, then fail
            failed += 1
            print(f"FAIL  {name}: {type(exc).__name__}: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
