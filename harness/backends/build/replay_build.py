"""Building `llama-replay` (harness/data/llama-replay.cpp) beside llama-server: one row of logits recomputed through
the very libraries the build links, in the batches a request was computed in (harness.backends.replay_tool runs it).

It is compiled against the tree's public headers and linked with llama-server's own link command (its objects
swapped for the tool's): the same archives, or the same llama-cpp-python libraries for a linked build, the same
system libraries (CUDA's on a CUDA build). A tree whose llama.h the tool does not compile against (an old commit)
builds without it: the build says why in its log and the re-score goes through llama-server as before.
"""

from __future__ import annotations

import hashlib
import subprocess
from importlib import resources
from pathlib import Path

from harness.errors import HarnessError

REPLAY = "llama-replay"


def replay_source() -> Path:
    """The tool's C++ source, shipped with the package."""
    return Path(str(resources.files("harness") / "data" / "llama-replay.cpp"))


def replay_digest() -> str:
    """sha256 of the tool's source: part of every build key, so a changed tool is rebuilt."""
    return hashlib.sha256(replay_source().read_bytes()).hexdigest()[:16]


def build_replay(server_link: list[str], build_dir: Path, source: Path, output: Path, log, run) -> str:
    """Compile the tool in `build_dir` and link it to `output` with `server_link` (llama-server's link argv,
    relative to `build_dir`, already pointing at the libraries it should link); `run(argv, cwd)` runs a step
    into `log` and returns its status. '' on success, else why it was not built (said in the log too)."""
    obj = build_dir / "llama-replay.o"
    compile_ = [server_link[0], "-O2", "-std=c++17", "-I", str(source / "include"), "-I", str(source / "ggml/include")]
    compile_ += ["-c", str(replay_source()), "-o", str(obj)]
    steps = [compile_, replay_link(server_link, obj, output)]
    for argv in steps:
        log.write("$ " + " ".join(argv) + "\n")
        log.flush()
        if run(argv, build_dir) != 0:
            why = f"{REPLAY} not built: `{Path(argv[0]).name}` failed on it (see above); re-scores use llama-server"
            log.write(f"# {why}\n")
            return why
    return ""


def replay_link(server_link: list[str], obj: Path, output: Path) -> list[str]:
    """llama-server's link argv with its own objects (the tree's `.o` files) replaced by the tool's `obj` and
    `output` for its `-o`: the archives and libraries it names stay, an unused archive member is not linked."""
    if "-o" not in server_link:
        raise HarnessError("llama-server's link command has no -o")
    out_at = server_link.index("-o") + 1
    argv = [a for i, a in enumerate(server_link) if i == out_at or not _tree_object(a)]
    argv[argv.index("-o") + 1] = str(output)
    return [argv[0], str(obj), *argv[1:]]


def _tree_object(arg: str) -> bool:
    return arg.endswith(".o") and not arg.startswith("/")


def probe(binary: Path) -> str:
    """'' when `binary` runs (it answers empty input with its one-line usage error), else why not."""
    try:
        proc = subprocess.run([str(binary)], input=b"", capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{REPLAY} does not run: {err}"
    if b"llama-replay:" not in proc.stderr:
        return f"{REPLAY} does not run: exit {proc.returncode}, {proc.stderr.decode(errors='replace').strip()[:200]}"
    return ""
