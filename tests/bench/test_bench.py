"""The benchmark harness in --quick mode on tiny models: it runs, writes JSON/markdown/PNG,
checks greedy identity inside the benchmark, and its analysis is sound (no timing assertions)."""

import json

import pytest
import torch

from specdecode.bench.harness import BenchConfig, Cell, load_prompts
from specdecode.bench.methods import RunResult
from specdecode.bench.report import predicted_speedup
from specdecode.cli import main
from specdecode.engine.stats import GenerationStats, RoundRecord
from tests.tiny import save_pair



@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("bench-models"), seed=21, scale=0.4, noise=0.05, max_len=2048)


def test_prompt_sets_are_complete():
    for name in ("codegen", "codeedit", "chat"):
        items = load_prompts(name)
        assert len(items) >= 8 and len({i["id"] for i in items}) == len(items)
        assert all(isinstance(i["prompt"], str) and i["prompt"] for i in items)
    assert any(not i["chat"] for i in load_prompts("codegen"))  # completions, not only instructions
    assert all("```" in i["prompt"] for i in load_prompts("codeedit"))  # a file to edit


def test_quick_bench_writes_reports(model_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["bench", "--quick", "--target", model_dirs[0], "--draft", model_dirs[1], "--dtype", "float32",
               "--out", str(out), "--max-new-tokens", "12"])
    printed = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(printed[-1])
    assert rc == 0 and summary["errors"] == 0  # every greedy method matched the baseline (float32)
    doc = json.loads((out / "results.json").read_text())
    rows = doc["summary"]["codegen"]["greedy"]
    assert {"plain", "model K=2", "model K=4", "model adaptive", "auto adaptive", "lookup adaptive",
            "suffix adaptive", "hf plain", "hf assisted", "hf prompt-lookup"} <= set(rows)
    assert rows["plain"]["speedup"] == pytest.approx(1.0)
    assert rows["model K=4"]["predicted"] is not None and rows["model K=4"]["efficiency"] is not None
    assert "vs_hf_assisted" in rows["model K=4"]
    assert len(doc["meta"]["cost_curve"]) >= 9
    md = (out / "results.md").read_text()
    assert "| model K=4 |" in md and "efficiency" in md
    png = (out / "speedup.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_wrong_answers_are_reported_as_errors():
    from specdecode.bench.harness import _check_identity
    good = Cell([RunResult([1, 2, 3], 1.0, None)])
    bad = Cell([RunResult([1, 2, 4], 1.0, None)])
    errors, divergences = [], []
    _check_identity({"plain": good, "x": good, "broken": bad}, "set/p", True, errors, divergences)
    assert errors == ["set/p: 'broken' differs from the baseline from token 2"] and not divergences
    _check_identity({"plain": good, "broken": bad}, "set/p", False, errors := [], divergences)
    assert not errors and len(divergences) == 1


def test_predicted_speedup_matches_the_closed_form():
    """Rounds of K=4 with alpha 0.75 measured, flat curve, draft step 0.1: E[N] c/(c+K) with c = 10."""
    from specdecode.core.theory import speedup
    stats = GenerationStats()
    outcomes = [4, 3, 4, 0, 4, 2, 4, 1]  # accepted per round
    for n in outcomes:
        stats.add_round(RoundRecord("model", 4, n, n + 1, t_draft=0.4, t_verify=1.0, verified=5))
    tested = sum(min(n + 1, 4) for n in outcomes)
    alpha = sum(outcomes) / tested
    assert predicted_speedup(stats, [1.0] * 6) == pytest.approx(speedup(alpha, 10.0, 4))


def test_bench_config_validation():
    with pytest.raises(ValueError, match="unknown prompt set"):
        BenchConfig(sets=("poetry",))
    with pytest.raises(ValueError, match="modes"):
        BenchConfig(modes=("beam",))


@pytest.mark.slow
def test_bench_on_llamacpp_has_llamacpp_peers(tmp_path, capsys):
    """The default backend for the embedded GGUF pair: llama.cpp's own decoders are rows of the table
    (run in their own process), and every method is also reported against the fastest plain decoder."""
    out = tmp_path / "out"
    rc = main(["bench", "--quick", "--sets", "codeedit", "--k-sweep", "2", "--max-new-tokens", "8",
               "--out", str(out)])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and summary["errors"] == 0
    rows = json.loads((out / "results.json").read_text())["summary"]["codeedit"]["greedy"]
    assert {"plain", "auto adaptive", "lookup adaptive", "llama.cpp plain", "llama.cpp prompt-lookup"} <= set(rows)
    assert not any(name.startswith("hf") for name in rows)  # HF needs the float32 conversion: opt-in here
    fastest = max(rows[m]["tokens_per_s"] for m in ("plain", "llama.cpp plain"))
    assert max(rows[m]["vs_fastest_plain"] for m in ("plain", "llama.cpp plain")) == pytest.approx(1.0)
    assert rows["plain"]["vs_fastest_plain"] == pytest.approx(rows["plain"]["tokens_per_s"] / fastest)
    assert "vs fastest plain" in (out / "results.md").read_text()



def test_the_suffix_methods_count_each_request_alone(model_dirs):
    """The bench's suffix drafter keeps no history: each cell runs its prompt `reps` times, and a
    history would copy the earlier runs of the same prompt. With --tree and --verify it runs again."""
    from specdecode.backends.weights import load_model
    from specdecode.bench.methods import REQUEST_ONLY, our_methods
    from specdecode.core.probs import GREEDY
    from specdecode.drafters.suffix import SuffixConfig, SuffixDrafter

    target, tokenizer = load_model(model_dirs[0], "target", torch.float32, "cpu", progress=False)
    methods = our_methods(target, tokenizer, None, None, [2], frozenset(), ("token", "block"), (3,))
    assert {m.name for m in methods if m.name.startswith("suffix")} == {
        "suffix adaptive", "suffix adaptive, tree 3", "suffix adaptive (block)"}
    text = list(range(10, 30))
    for config, copies in ((REQUEST_ONLY, False), (SuffixConfig(), True)):  # the default keeps a history
        drafter = SuffixDrafter(config)
        drafter.propose(text, 4, GREEDY, torch.Generator())  # a first request, run to its end
        drafter.reset()
        again = drafter.propose(text[:5], 4, GREEDY, torch.Generator()).tokens  # the same text asked again
        assert again == ([15, 16, 17, 18] if copies else [])
