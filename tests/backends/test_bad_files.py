"""Paths and files that are not what a model option needs give one-line errors naming the problem
and the fix, never a reader's traceback: a cut-off GGUF, a directory named *.gguf, a file inside
a model directory, an empty path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specdecode.backends import weights
from specdecode.backends.weights import load_model, resolve_backend


def write_gguf(path: Path) -> Path:
    """A few-hundred-byte GGUF written by the gguf package: metadata and two float32 tensors of 32 bytes
    each, so the file ends with the last tensor's bytes (no alignment padding to cut off harmlessly)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_tensor("a.weight", np.arange(8, dtype=np.float32))
    writer.add_tensor("b.weight", np.ones((2, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load(ref, backend="transformers"):
    return load_model(ref, "target", torch.float32, "cpu", progress=False, backend=backend)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(weights, "_convert", lambda *a, **k: pytest.fail("converted a file that is not complete"))


def test_the_intact_file_passes_the_check(tmp_path):
    weights.check_complete_gguf(write_gguf(tmp_path / "whole.gguf"))


@pytest.mark.parametrize("keep", [0, 8, 30, 100, -4], ids=["empty", "magic and version", "mid-header",
                                                           "mid-metadata", "last tensor cut"])
def test_a_cut_off_gguf_is_named_as_incomplete(tmp_path, cache, keep):
    whole = write_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:keep])
    assert cut.stat().st_size < len(whole)
    with pytest.raises(ValueError, match=r"'.*cut\.gguf' is not a complete GGUF file \(.*\); .*copy or download "
                                         r"it again"):
        load(str(cut))


def test_a_hand_written_header_alone_is_named_as_incomplete(tmp_path, cache):
    (tmp_path / "trunc.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ValueError, match="is not a complete GGUF file"):
        load(str(tmp_path / "trunc.gguf"))


@pytest.mark.parametrize("backend", ["transformers", "llama.cpp", "native"])
def test_a_directory_named_gguf_is_a_directory(tmp_path, cache, backend):
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(ValueError, match=r"'.*dir\.gguf' is a directory, not a GGUF file; pass the \.gguf file"):
        load(str(tmp_path / "dir.gguf"), backend)


def test_a_missing_gguf_still_does_not_exist(tmp_path, cache):
    with pytest.raises(ValueError, match=r"GGUF file '.*absent\.gguf' does not exist"):
        load(str(tmp_path / "absent.gguf"))


def test_a_file_inside_a_model_directory_is_a_file(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"'.*config\.json' is a file, not a model directory: give the "
                                         r"directory that holds config\.json"):
        load(str(tmp_path / "target" / "config.json"))


@pytest.mark.parametrize("backend", ["auto", "transformers", "llama.cpp", "native"])
def test_an_empty_path_is_empty(backend):
    with pytest.raises(ValueError, match=r"the model path is empty; pass a transformers model directory"):
        resolve_backend(backend, "", "cpu")
    with pytest.raises(ValueError, match=r"the target path is empty"):
        load("", "transformers" if backend == "auto" else backend)


@pytest.mark.parametrize("backend", ["llama.cpp", "transformers", "native"])
def test_a_file_that_is_not_gguf_is_named_so(tmp_path, cache, backend):
    """Random bytes named .gguf: one line saying what the file is not, before llama.cpp logs its refusal
    and suggests another backend (which cannot read it either)."""
    (tmp_path / "junk.gguf").write_bytes(b"not a model at all" * 8)
    with pytest.raises(ValueError, match=r"'.*junk\.gguf' is not a GGUF file: it does not start with the bytes 'GGUF'"):
        load(str(tmp_path / "junk.gguf"), backend)
