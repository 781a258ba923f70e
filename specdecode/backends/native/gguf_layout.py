"""A GGUF file's layout: its model settings and where each tensor lies, read with the gguf package.

The gguf package's reader parses every key of the file, the tokenizer's 150,000 strings included:
16 seconds for the embedded target. The layout is small, so it is read once per file and kept in
the cache (keyed by path, size and modification time); later loads map the file and read the
tensors at their offsets.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

LAYOUT_VERSION = 1


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    type: int            # ggml_type
    shape: tuple[int, ...]  # GGUF order: shape[0] is the row length (inputs), shape[1] the rows
    offset: int          # bytes from the start of the file
    nbytes: int


@dataclass(frozen=True, slots=True)
class Layout:
    architecture: str
    fields: dict          # the model's scalar settings ("qwen2.block_count": 28, ...)
    tensors: dict         # name -> Tensor

    def field(self, key: str, default=None):
        value = self.fields.get(f"{self.architecture}.{key}", default)
        if value is None:
            raise ValueError(f"the GGUF has no {self.architecture}.{key}, which the native backend needs")
        return value


def read_layout(path: Path, cache: Path | None) -> Layout:
    """The layout of `path`, from `cache` (a directory) when it holds it, else read and stored there."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{LAYOUT_VERSION}".encode()).hexdigest()[:16]
    stored = cache / f"{path.stem}-{key}.json" if cache is not None else None
    if stored is not None and stored.is_file():
        try:
            return _from_json(json.loads(stored.read_text()))
        except (ValueError, KeyError, TypeError):
            pass  # a damaged copy: read the file again
    layout = _read(path)
    if stored is not None:
        try:
            stored.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=stored.parent, prefix=".layout-")
            with os.fdopen(fd, "w") as f:
                json.dump(_to_json(layout), f)
            os.replace(tmp, stored)
        except OSError:
            pass  # an unwritable cache only costs the next load the same read
    return layout


def _read(path: Path) -> Layout:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, struct.error, IndexError, KeyError, OverflowError) as exc:
        raise ValueError(f"{str(path)!r} is not a complete GGUF file ({exc}); it may be a partial download or "
                         f"copy: copy or download it again") from exc
    fields = {}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer.") or name.startswith("GGUF."):
            continue
        try:
            value = field.contents()
        except (ValueError, IndexError):
            continue
        if isinstance(value, (int, float, str, bool)):
            fields[name] = value
    architecture = fields.get("general.architecture")
    if not isinstance(architecture, str):
        raise ValueError(f"{str(path)!r} names no model architecture (general.architecture)")
    tensors = {t.name: Tensor(t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset),
                              int(t.n_bytes)) for t in reader.tensors}
    return Layout(architecture, fields, tensors)


def _to_json(layout: Layout) -> dict:
    return {"architecture": layout.architecture, "fields": layout.fields,
            "tensors": [[t.name, t.type, list(t.shape), t.offset, t.nbytes] for t in layout.tensors.values()]}


def _from_json(data: dict) -> Layout:
    tensors = {name: Tensor(name, int(kind), tuple(shape), int(offset), int(nbytes))
               for name, kind, shape, offset, nbytes in data["tensors"]}
    return Layout(str(data["architecture"]), dict(data["fields"]), tensors)
