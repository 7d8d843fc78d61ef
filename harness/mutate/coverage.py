"""Which lines of the mutated files the battery executes: line coverage of the unmutated llama-server over every
suite of the campaign (and, separately, over llama.cpp's own server tests), measured once per campaign.

A mutant on a line that is executable and that no run executes cannot change what any cell returns: it is built
(one that does not compile is stillborn, as any other) but not served, and survives (`reached: false`), which is
what serving it would show. A reached mutant meets only the cells that execute its line and the cells that compare
with one of them (`cells_to_serve`): each cell's llama-server writes its counters apart
(harness.execute.executor.CELL_COUNTERS), and a cell none of whose runs or references execute the line serves what
it served unmutated. A suite none of whose cells execute it is not run at all. A mutant on a line gcov does not list
as executable (a declaration, the rest of a statement spanning lines) is built and served as any other, by every
suite. The argument is the one every coverage-based mutation tool makes (Stryker's per-test coverage, mutmut's
--use-coverage); its one caveat is a line that only some timings execute (par batches), measured once.

The coverage build is a second copy of the tree whose common/ and tools/server/ CMake files add `--coverage` to
the targets that hold the mutated code (llama-common, server-context, llama-server): it is built through the build
cache like any tree, linked against llama-cpp-python's libraries (their sources are untouched). llama-server writes
its counters (.gcda) when it exits (the harness stops it with SIGTERM): GCOV_PREFIX sends them to the campaign, and
`gcov --json-format` reads them with the build tree's notes (.gcno).
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from harness.backends.build import build_tree_dir, ensure_server, work_dir
from harness.errors import HarnessError
from harness.execute.executor import CELL_COUNTERS
from harness.matrix import Cell

COVERAGE_CMAKE = {
    "common/CMakeLists.txt": (
        "\n# specharness mutate: line coverage (whatever links the library links gcov's runtime)\n"
        "target_compile_options(llama-common PRIVATE --coverage)\n"
        "target_link_options(llama-common INTERFACE --coverage)\n"
    ),
    "tools/server/CMakeLists.txt": (
        "\n# specharness mutate: line coverage\n"
        "target_compile_options(server-context PRIVATE --coverage)\n"
        "target_link_options(server-context INTERFACE --coverage)\n"
    ),
}
FILE = "coverage.json"


def coverage_tree(tree: Path) -> Path:
    """A copy of `tree` (the campaign's clean copy) with COVERAGE_CMAKE appended, kept beside it."""
    target = tree.with_name(tree.name + "-coverage")
    if (target / "CMakeLists.txt").is_file() and all(
        (target / rel).read_text().endswith(text) for rel, text in COVERAGE_CMAKE.items()
    ):
        return target
    shutil.rmtree(target, ignore_errors=True)
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(tree, staging, symlinks=True)
    for rel, text in COVERAGE_CMAKE.items():
        with open(staging / rel, "a") as f:
            f.write(text)
    staging.rename(target)
    return target


def build(tree: Path):
    """The coverage build of `tree`'s copy and the persistent build tree that holds its notes (.gcno): the tree of
    the source the cached build was made from (a copy of another campaign's tree with the same bytes shares it)."""
    info = ensure_server(source=coverage_tree(tree))
    return info, build_tree_dir(Path(info.source), info.backend, list(info.cmake_args))


def _strip() -> str:
    """GCOV_PREFIX_STRIP: the work path's prefix stripped from the counters' paths (the build runs at
    `<cache>/work`)."""
    return str(len(work_dir().resolve().parts) - 1)


def counter_env(out: Path) -> dict:
    """The environment that sends every llama-server's counters under `out` (llama.cpp's own tests' servers)."""
    return {"GCOV_PREFIX": str(out), "GCOV_PREFIX_STRIP": _strip()}


def cell_counter_env(out: Path) -> dict:
    """The environment of a `specharness run` whose cells' llama-servers write their counters under
    `out/<cell id>`, each apart."""
    return {CELL_COUNTERS: str(out), "GCOV_PREFIX_STRIP": _strip()}


def read_cells(counters: Path, tree_dir: Path, source: Path, files: list[str]) -> dict[str, dict[str, dict]]:
    """cell id -> `read`'s result, for every cell whose llama-server wrote counters under `counters/<cell id>`."""
    cells = sorted(p for p in counters.iterdir() if p.is_dir()) if counters.is_dir() else []
    return {cell.name: read(cell, tree_dir, source, files) for cell in cells}


def cells_to_serve(line_cells: set[str], suite_cells: Sequence[Cell], measured: set[str]) -> list[str]:
    """The ids of those of `suite_cells` a mutant must meet: each cell whose own runs execute its line
    (`line_cells`) or wrote no counters at all (`measured` lacks it: not known, so served), and each cell that
    compares with one of them (lossless with spec none, mode-invariant with seq, logits-close with both;
    harness.matrix.shard's references): a verdict of any other cell reads only outputs the mutant cannot change."""
    reaching = set(line_cells) | {c.id for c in suite_cells if c.id not in measured}

    def compares_with_reaching(cell: Cell) -> bool:
        refs = (cell, cell.reference(spec="none"), cell.reference(mode="seq"), cell.reference(mode="seq", spec="none"))
        return any(ref.id in reaching for ref in refs)

    return [c.id for c in suite_cells if compares_with_reaching(c)]


def read(counters: Path, tree_dir: Path, source: Path, files: list[str]) -> dict[str, dict[str, list[int]]]:
    """file -> {"executable": lines, "covered": lines} from the counters under `counters` (laid out as the build
    tree: build/<dir>/CMakeFiles/<target>.dir/<file>.gcda) and the notes in `tree_dir`."""
    out = {}
    for rel in files:
        name = Path(rel).name
        notes = sorted(tree_dir.glob(f"build/**/{name}.gcno"))
        if not notes:
            raise HarnessError(
                f"the coverage build has no notes for {rel} in {tree_dir}: was it built with --coverage?"
            )
        executable, covered = set(), set()
        for gcno in notes:
            gcda = counters / gcno.relative_to(tree_dir).with_suffix(".gcda")  # build/<dir>/<file>.cpp.gcda
            work = counters / "gcov" / gcno.parent.name
            work.mkdir(parents=True, exist_ok=True)
            shutil.copy2(gcno, work / gcno.name)
            if gcda.is_file():
                shutil.copy2(gcda, work / gcda.name)
            for line, count in _gcov(work, source / rel, name):
                executable.add(line)
                if count:
                    covered.add(line)
        out[rel] = {"executable": sorted(executable), "covered": sorted(covered)}
    return out


def union(measured) -> dict[str, dict[str, list[int]]]:
    """file -> {"executable", "covered"} over several of `read`'s results (the lines any of them executes)."""
    out: dict[str, dict[str, set[int]]] = {}
    for reach in measured:
        for rel, lines in reach.items():
            merged = out.setdefault(rel, {"executable": set(), "covered": set()})
            merged["executable"].update(lines["executable"])
            merged["covered"].update(lines["covered"])
    return {rel: {key: sorted(v) for key, v in lines.items()} for rel, lines in out.items()}


def _gcov(objdir: Path, source: Path, name: str) -> list[tuple[int, int]]:
    """(line, count) of every executable line of `source` in the counters of `objdir` (gcov's JSON)."""
    proc = subprocess.run(
        ["gcov", "--json-format", "--stdout", "-o", str(objdir / (name + ".o")), str(source)],
        capture_output=True,
        cwd=objdir,
        timeout=300,
    )
    if proc.returncode != 0:
        raise HarnessError(f"gcov failed on {source}: {proc.stderr.decode(errors='replace').strip()[:300]}")
    lines = []
    for chunk in proc.stdout.splitlines():
        try:
            data = json.loads(gzip.decompress(chunk) if chunk[:2] == b"\x1f\x8b" else chunk)
        except ValueError:
            continue
        for f in data.get("files", []):
            if Path(f["file"]).name == name:
                lines += [(ln["line_number"], ln["count"]) for ln in f["lines"]]
    return lines
