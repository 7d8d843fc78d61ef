"""Incremental llama-server builds (`specharness bench build-step`): a copy of the vendored tree built
as it is, then after a real change to one source file, as a bisect step would."""

import shutil
import time
from pathlib import Path


def bench_build_step(file: str, jobs: int | None) -> dict:
    """Build a copy of the vendored tree as it is, then twice after a real code change to `file`: the first
    change is built in the copy's own build tree (a fresh one on the first run: configure plus the
    compiler cache), the second is the incremental step of a bisect (one file recompiled, relinked)."""
    from harness.backends.build import SOURCE_MARKER, build_tree_dir, cmake_options, ensure_server, vendored_source
    from harness.paths import cache_dir

    vendored = vendored_source()
    copy = cache_dir() / "bench" / f"{vendored.name}-copy"
    if not (copy / SOURCE_MARKER).is_file():  # copied to a temp name first: the marker means complete
        tmp = copy.with_name(copy.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(vendored, tmp, ignore=lambda d, names: {"models"} & set(names) if Path(d) == vendored else ())
        shutil.rmtree(copy, ignore_errors=True)
        tmp.rename(copy)
    original = (vendored / file).read_text()
    row: dict = {"file": file, "fresh_tree": not build_tree_dir(copy, "cpu", cmake_options("cpu")).exists()}
    for label, stamp in (("copy", None), ("first_edit", 1), ("incremental_edit", 2)):
        edit = f'static const char * bench_stamp = "{time.time_ns()}-{stamp}";\n' if stamp else ""
        (copy / file).write_text(original + edit)
        t0 = time.perf_counter()
        info = ensure_server(copy, "cpu", [], jobs)
        row[f"{label}_seconds"] = round(time.perf_counter() - t0, 1)
        root = info.server_bin.parent.parent
        log = (root / "build.log").read_text(errors="replace") if not info.cached else ""
        row[f"{label}_build"] = (
            "cached"
            if info.cached
            else next((line[2:] for line in log.splitlines() if line.startswith("# compiler cache")), "built")
        )
        if stamp:
            shutil.rmtree(root)  # a one-off binary: keep the cache small
    (copy / file).write_text(original)
    return row
