"""Which backend runs a GGUF file: native where this CPU runs its kernels, llama.cpp (said in one line)
where it cannot, and an explicit --backend native refused there with the reason."""

import pytest

import specdecode.backends.native as native
import specdecode.backends.native.weights as native_weights
from specdecode.backends.weights import resolve_backend
from tests.backends.native import tiny


def test_auto_runs_gguf_on_the_native_backend():
    assert resolve_backend("auto", None, "cpu") == "native"
    assert resolve_backend("auto", "model.gguf", "cpu") == "native"
    assert resolve_backend("auto", "some/directory", "cpu") == "transformers"
    assert resolve_backend("auto", None, "cuda") == "transformers"


def test_a_cpu_without_avx2_gets_llama_cpp_and_one_line(monkeypatch, capsys):
    why = "this CPU has no AVX2 (with FMA and F16C), which the native kernels need"
    monkeypatch.setattr(native, "unavailable", lambda: why)
    assert resolve_backend("auto", None, "cpu") == "llama.cpp"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and why in err and "using llama.cpp" in err
    with pytest.raises(ValueError, match="the native backend cannot run here: this CPU has no AVX2"):
        resolve_backend("native", None, "cpu")


def test_native_runs_gguf_on_the_cpu_only():
    with pytest.raises(ValueError, match="the native backend runs GGUF files"):
        resolve_backend("native", "some/directory", "cpu")
    with pytest.raises(ValueError, match="runs on the CPU here"):
        resolve_backend("native", None, "cuda")


def test_auto_gives_llama_cpp_a_gguf_our_kernels_cannot_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    qwen2 = tiny.build(tmp_path / "qwen2.gguf").path
    assert resolve_backend("auto", qwen2, "cpu") == "native"
    assert capsys.readouterr().err == ""
    llama = tiny.build(tmp_path / "llama.gguf", architecture="llama").path
    assert resolve_backend("auto", llama, "cpu") == "llama.cpp"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "runs the qwen2 architecture, not llama" in err and "using llama.cpp" in err
    monkeypatch.setattr(native_weights, "MATRIX_TYPES", {12: "Q4_K", 14: "Q6_K", 8: "Q8_0"})  # as if Q5_0 were not read
    assert resolve_backend("auto", qwen2, "cpu") == "llama.cpp"
    assert "is Q5_0, which the native kernels do not read" in capsys.readouterr().err
    with pytest.raises(ValueError, match="runs the qwen2 architecture, not llama"):
        native_weights.NativeWeights(llama, native_weights.NativeSettings(), "llama")
