"""The CMake / Ninja step: configuring and compiling llama-server and llama-quantize in a persistent build tree per
(source directory, backend, options), with ccache as the compiler launcher when it is installed, so a new commit of a
checkout recompiles only the files it changed and a copy of a tree built before costs little."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager, suppress
from pathlib import Path

from harness.backends.build.entry import BuildInfo, _locked
from harness.backends.build.replay_build import REPLAY, build_replay, probe
from harness.backends.build.sources import SourceIdentity, tag_of
from harness.backends.build.wheel_link import (
    WheelLibraries,
    copy_libraries,
    link_command,
    link_plan,
    relinked,
)
from harness.errors import HarnessError
from harness.paths import cache_dir

BACKENDS = ("cpu", "cuda", "metal")
TARGETS = ("llama-server", "llama-quantize")


LOG_TAIL_LINES = 40


def cmake_options(backend: str, extra: list[str] = ()) -> list[str]:
    """The CMake cache options for `backend` (cpu, cuda, metal) followed by the user's `extra` ones.

    Self-contained Release binary, no network access at configure or build time (no curl, no openssl,
    no web UI download), no tests or examples. `extra` comes last so it can override anything.
    """
    if backend not in BACKENDS:
        raise HarnessError(f"unknown build backend '{backend}' (use one of: {', '.join(BACKENDS)})")
    return [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",
        f"-DGGML_CUDA={'ON' if backend == 'cuda' else 'OFF'}",
        f"-DGGML_METAL={'ON' if backend == 'metal' else 'OFF'}",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_SERVER=ON",
        *extra,
    ]


def check_platform(backend: str, system: str | None = None) -> None:
    """Refuse backends that cannot be built on `system` (default: this one); Metal needs macOS."""
    system = system or platform.system()
    if backend == "metal" and system != "Darwin":
        raise HarnessError(f"the metal backend needs macOS, this is {system}; use --backend cpu or cuda")


# ---------------------------------------------------------------------------------------- sources


def _build_into(
    tmp: Path,
    source: Path,
    identity: SourceIdentity,
    backend: str,
    args: list[str],
    root: Path,
    jobs: int,
    libraries: WheelLibraries | None,
) -> BuildInfo:
    """Build in the persistent tree of (source, backend, args), then put the binaries into `tmp/bin` (linked
    against `libraries`, copied into `tmp/lib`, when given and the link works; else compiled in)."""
    log_path = tmp / "build.log"
    tmp.mkdir(parents=True)
    started = time.monotonic()
    stats_log = tmp / "ccache-stats.log"
    env = compiler_cache_env(stats_log)
    with _mounted_tree(source, backend, args) as work, open(log_path, "w") as log:
        build_dir = work / "build"
        what = f"against {libraries.describe()}" if libraries else "with its libraries compiled in"
        print(
            f"building llama-server {identity} ({backend}) {what}, with {jobs} jobs in "
            f"{build_tree_dir(source, backend, args)}; log: {log_path}",
            file=sys.stderr,
        )
        if not _configured(build_dir):  # a configured tree re-runs CMake by itself when a CMakeLists.txt changes
            configure = ["cmake", "-S", str(work / "src"), "-B", str(build_dir), *_toolchain_args(backend), *args]
            _step(root, log_path, log, "configure", configure, env)
        (tmp / "bin").mkdir()
        linked = libraries is not None and _link_to_libraries(
            libraries, build_dir, tmp, root, jobs, log, env, lambda step: _fail(root, log_path, step)
        )
        if not linked:
            build = ["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TARGETS]
            _step(root, log_path, log, "build", build, env)
            for target in TARGETS:
                shutil.copy2(build_dir / "bin" / target, tmp / "bin" / target)
        replay = _replay(work, tmp, root, linked, log, env)
        compiler = _compiler(build_dir)
    hits = compiler_cache_hits(stats_log)
    stats_log.unlink(missing_ok=True)
    info = BuildInfo(
        server_bin=root / "bin" / "llama-server",
        quantize_bin=root / "bin" / "llama-quantize",
        commit=identity.commit,
        dirty=identity.dirty,
        backend=backend,
        cmake_args=args,
        compiler=compiler,
        built_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        source=str(source),
        source_identity=str(identity),
        build_seconds=round(time.monotonic() - started, 1),
        linked_libraries=libraries.describe() if linked else "",
        tag=tag_of(source) or "",
        replay_bin=root / "bin" / REPLAY if replay else None,
    )
    with open(log_path, "a") as log:
        log.write(f"# compiler cache: {hits}\n" if hits else "# compiler cache: not used\n")
    (tmp / "build-info.json").write_text(json.dumps(info.to_json(), indent=2) + "\n")
    return info


def _replay(work: Path, tmp: Path, root: Path, linked: bool, log, env: dict) -> bool:
    """Build `llama-replay` into `tmp/bin` with llama-server's link (against the entry's `lib/` when `linked`);
    False, said in the log, when it could not be built or does not run (the build goes on without it)."""
    build_dir = work / "build"
    try:
        server = link_command(build_dir, "llama-server")
    except HarnessError as err:
        log.write(f"# {REPLAY} not built: {err}\n")
        return False
    if linked:
        server = relinked(server, tmp / "lib", tmp / "bin" / "llama-server", root / "lib")
    output = tmp / "bin" / REPLAY
    why = build_replay(server, build_dir, work / "src", output, log, lambda argv, cwd: _run_logged(argv, log, env, cwd))
    why = why or probe(output)
    if why:
        log.write(f"# {why}\n")
        output.unlink(missing_ok=True)
    return not why


def _step(root: Path, log_path: Path, log, step: str, cmd: list[str], env: dict) -> None:
    """Run one build step with its command line and output in the build log; a failure ends the build."""
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    if _run_logged(cmd, log, env) != 0:
        _fail(root, log_path, step)


def _link_to_libraries(
    libraries: WheelLibraries,
    build_dir: Path,
    tmp: Path,
    root: Path,
    jobs: int,
    log,
    env: dict,
    fail: Callable[[str], None],
) -> bool:
    """Compile what TARGETS need but the wheel's libraries (a compile error ends the build through `fail`), make
    their other archives, then link each into `tmp/bin` against copies of those libraries in `tmp/lib` (run path:
    beside the binary, then `root/lib`, where the entry will be). False
    (said in the log) when the tree's commands are not as expected or an archive or link step fails: the caller
    then compiles the libraries as well."""
    try:
        plan = link_plan(build_dir, TARGETS)
    except HarnessError as err:
        log.write(f"# not linking llama-cpp-python's libraries: {err}\n")
        return False
    compile_ = ["ninja", "-C", str(build_dir), "-j", str(jobs), *plan.objects]
    log.write("$ " + " ".join(compile_) + "\n")
    log.flush()
    if _run_logged(compile_, log, env) != 0:
        fail("build")
    copy_libraries(libraries, tmp / "lib")
    steps = [["/bin/sh", "-c", command] for command in plan.archives.values()]
    final = root / "lib"
    steps += [relinked(argv, tmp / "lib", tmp / "bin" / target, final) for target, argv in plan.links.items()]
    for cmd in steps:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        if _run_logged(cmd, log, env, cwd=build_dir) != 0:
            log.write("# linking llama-cpp-python's libraries failed; compiling them instead\n")
            shutil.rmtree(tmp / "lib", ignore_errors=True)
            return False
    return True


# --------------------------------------------------------------------------- persistent build trees
#
# Every build happens in one persistent CMake/Ninja tree per (source directory, backend, options), kept
# in `cache_dir()/trees/<name>/`: a later build of the same checkout at another commit recompiles only
# what changed (Ninja's own dependency tracking). While it builds, the tree is renamed to the fixed
# path `cache_dir()/work/`, whose `src` is a symlink to the source: every build of every source then
# runs the very same compiler command lines, so the compiler cache (ccache) also serves a different
# directory holding nearly the same tree, e.g. a copy of the vendored llama.cpp with one edit. One
# build at a time per cache (the work path is one); a tree left at the work path by a killed process
# is put back first.

TREE_MARKER = ".specharness-tree"


def build_tree_dir(source: Path, backend: str, args: list[str]) -> Path:
    """The persistent build tree of (source directory, backend, CMake arguments)."""
    blob = json.dumps({"source": str(Path(source).resolve()), "backend": backend, "cmake": args})
    return cache_dir() / "trees" / f"{backend}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def work_dir() -> Path:
    """The work path every build runs at (its tree mounted there, the source linked at `src`): the paths a compiler
    and gcov name start with it."""
    return cache_dir() / "work"


@contextmanager
def _mounted_tree(source: Path, backend: str, args: list[str]):
    """The tree of (source, backend, args) at the work path, under the work lock; put back afterwards."""
    work = work_dir()
    home = build_tree_dir(source, backend, args)
    with _locked(work, "the build work tree (one build at a time)"):
        _unmount(work)
        home.parent.mkdir(parents=True, exist_ok=True)
        if home.is_dir():
            home.rename(work)
        else:
            (work / "build").mkdir(parents=True)
        try:
            (work / TREE_MARKER).write_text(home.name + "\n")
            link = work / "src"
            link.unlink(missing_ok=True)
            link.symlink_to(Path(source).resolve(), target_is_directory=True)
            yield work
        finally:
            _unmount(work)


def _unmount(work: Path) -> None:
    """Move the tree at the work path (if any) back to its home; one without a readable marker is deleted."""
    if not work.exists():
        return
    try:
        name = (work / TREE_MARKER).read_text().strip()
    except OSError:
        name = ""
    home = work.parent / "trees" / name
    if not name or "/" in name or home.exists():
        shutil.rmtree(work, ignore_errors=True)
    else:
        work.rename(home)


def _configured(build_dir: Path) -> bool:
    """Whether a configure step completed in `build_dir` (it wrote the generator's build file)."""
    return (build_dir / "build.ninja").is_file() or (build_dir / "Makefile").is_file()


def compiler_cache_env(stats_log: Path | None = None) -> dict:
    """The environment of a build: ccache keeps its cache in `cache_dir()/ccache` (unless CCACHE_DIR is
    set) and, with `stats_log`, records there the outcome of every compilation of this build."""
    env = dict(os.environ)
    env.setdefault("CCACHE_DIR", str(cache_dir() / "ccache"))
    if stats_log is not None:
        env["CCACHE_STATSLOG"] = str(stats_log)
    return env


def compiler_cache_hits(stats_log: Path) -> str:
    """'H of N compilations from the compiler cache' from a ccache stats log ('' when ccache was not used)."""
    try:
        lines = stats_log.read_text().split()
    except OSError:
        return ""
    hits = sum(1 for w in lines if w in ("direct_cache_hit", "preprocessed_cache_hit"))
    total = hits + sum(1 for w in lines if w == "cache_miss")
    return f"{hits} of {total} compilations from the compiler cache" if total else ""


def _toolchain_args(backend: str) -> list[str]:
    """Generator and compiler launcher options that do not change the binary (not part of the key)."""
    args = ["-G", "Ninja"] if shutil.which("ninja") else []
    if shutil.which("ccache"):
        langs = ("C", "CXX", "CUDA") if backend == "cuda" else ("C", "CXX")
        args += [f"-DCMAKE_{lang}_COMPILER_LAUNCHER=ccache" for lang in langs]
    return args


def _run_logged(cmd: list[str], log, env: dict | None = None, cwd: Path | None = None) -> int:
    """Run `cmd` with stdout and stderr appended to `log`, in a process group of its own; on Ctrl-C or
    SIGTERM kills the whole group (cmake, ninja and every compiler) and re-raises."""
    try:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
    except OSError as err:
        raise HarnessError(f"cannot run {cmd[0]}: {err}") from None
    try:
        return proc.wait()
    except BaseException:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def _fail(root: Path, log_path: Path, step: str) -> None:
    """Keep the log as `<root>.failed.log` and raise with its last lines."""
    kept = root.with_name(f"{root.name}.failed.log")
    log_path.replace(kept)
    tail = "\n".join(kept.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
    raise HarnessError(f"llama.cpp {step} failed (full log: {kept}); last lines:\n{tail}")


def _compiler(cmake_dir: Path) -> str:
    """'<id> <version> (<path>)' of the C++ (and CUDA) compiler, read from the CMake cache/files."""
    cache = (cmake_dir / "CMakeCache.txt").read_text(errors="replace")
    parts = []
    for lang in ("CXX", "CUDA"):
        path = re.search(rf"^CMAKE_{lang}_COMPILER:\w+=(.+)$", cache, re.M)
        if not path or path.group(1).endswith("NOTFOUND"):
            continue
        desc = path.group(1)
        for spec in cmake_dir.glob(f"CMakeFiles/*/CMake{lang}Compiler.cmake"):
            text = spec.read_text(errors="replace")
            cid = re.search(rf'set\(CMAKE_{lang}_COMPILER_ID "([^"]*)"\)', text)
            ver = re.search(rf'set\(CMAKE_{lang}_COMPILER_VERSION "([^"]*)"\)', text)
            desc = f"{cid.group(1) if cid else '?'} {ver.group(1) if ver else '?'} ({desc})"
        parts.append(desc)
    return "; ".join(parts) or "unknown"
