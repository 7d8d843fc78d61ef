"""`--releases A..B`: bisect over the llama.cpp trees vendored in llama-cpp-python's sdists.

Each release's sdist is fetched with pip and its `vendor/llama.cpp` extracted into the cache (as the
default source of `specharness build`); the oldest release must pass, the newest fail, and a binary
search narrows the regression to two consecutive releases, whose vendored llama.cpp commits bound the
range to bisect with git. Verdicts are logged like a checkout's steps, so `--resume` works the same.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from harness.backends.build import source_identity, vendored_source
from harness.bisect.driver import check_end
from harness.bisect.git import Commit
from harness.bisect.judge import BAD, GOOD
from harness.bisect.plan import Plan
from harness.bisect.result import Outcome, Stop
from harness.bisect.step import evaluate, read_log
from harness.errors import HarnessError

PACKAGE = "llama-cpp-python"


def _key(version: str) -> tuple[int, ...] | None:
    """(0, 3, 36) for a final release; None for pre-releases and anything else."""
    return tuple(int(p) for p in version.split(".")) if re.fullmatch(r"\d+(\.\d+)*", version) else None


def available_versions() -> list[str]:
    """The llama-cpp-python releases on the package index (`pip index versions`), oldest first."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", PACKAGE]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    listed = re.search(r"^Available versions: (.+)$", proc.stdout, re.M)
    if proc.returncode != 0 or not listed:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise HarnessError(f"could not list the {PACKAGE} releases with pip: {last}")
    versions = [v.strip() for v in listed.group(1).split(",")]
    return sorted((v for v in versions if _key(v)), key=_key)


def release_range(spec: str, available: list[str] | None = None) -> list[str]:
    """The releases from A to B (both included) of `A..B`, oldest first; both ends must exist."""
    match = re.fullmatch(r"\s*([\w.]+)\s*\.\.\s*([\w.]+)\s*", spec)
    if not match or not _key(match.group(1)) or not _key(match.group(2)):
        raise HarnessError(f"--releases wants OLD..NEW (e.g. 0.3.30..0.3.36), not '{spec}'")
    old, new = match.groups()
    if _key(old) >= _key(new):
        raise HarnessError(f"--releases {spec}: {old} is not older than {new}")
    available = available if available is not None else available_versions()
    for end in (old, new):
        if end not in available:
            raise HarnessError(
                f"{PACKAGE} {end} is not on the package index (releases: {', '.join(available[-8:])}, ...)"
            )
    return [v for v in available if _key(old) <= _key(v) <= _key(new)]


class ReleaseBisection:
    """Binary search over `plan.releases` (oldest good, newest bad), logging into `run_dir`."""

    def __init__(self, plan: Plan, run_dir: Path):
        self.plan = plan
        self.run_dir = run_dir

    def judge(self, version: str, role: str) -> dict:
        logged = [e for e in read_log(self.run_dir) if e.get("version") == version and e.get("verdict") != "error"]
        if logged:
            return logged[-1]
        tree = vendored_source(version)
        facts = {
            "role": role,
            "version": version,
            "commit": source_identity(tree).commit,
            "subject": f"llama.cpp vendored in {PACKAGE} {version}",
            "date": "",
        }
        entry = evaluate(self.plan, tree, self.run_dir, facts)
        print(
            f"bisect: {PACKAGE} {version} (llama.cpp {facts['commit'][:10]}) {entry['verdict']}: {entry['reason']}",
            file=sys.stderr,
        )
        return entry

    def run(self) -> Outcome:
        versions = self.plan.releases
        check_end(self.judge(versions[0], "verify-good"), GOOD, f"release {versions[0]}")
        check_end(self.judge(versions[-1], "verify-bad"), BAD, f"release {versions[-1]}")
        lo, hi, unjudged = 0, len(versions) - 1, set()
        while between := [i for i in range(lo + 1, hi) if i not in unjudged]:
            mid = between[len(between) // 2]
            verdict = self.judge(versions[mid], "step")["verdict"]
            if verdict == GOOD:
                lo = mid
            elif verdict == BAD:
                hi = mid
            else:
                unjudged.add(mid)
        if hi - lo > 1:
            raise Stop(f"the releases between {versions[lo]} (good) and {versions[hi]} (bad) cannot be judged")
        good, bad = self.judge(versions[lo], "parent"), self.judge(versions[hi], "step")
        hint = (
            f"Bisect the llama.cpp commits between them: specharness bisect --source LLAMA_CPP_CHECKOUT "
            f"--good {good['commit'][:10]} --bad {bad['commit'][:10]} --suite {self.plan.suite} "
            f"--case {self.plan.case} --mode {self.plan.mode} --spec {self.plan.spec} --model {self.plan.model} "
            f"--check {','.join(self.plan.checks)}"
        )
        return Outcome(
            first_bad=Commit(bad["commit"], bad["subject"], ""),
            parent=Commit(good["commit"], good["subject"], ""),
            first_bad_entry=bad,
            parent_entry=good,
            extra={"good_version": versions[lo], "bad_version": versions[hi], "hint": hint},
        )


def bisect_releases(plan: Plan, spec: str | None, run_dir: Path) -> Outcome:
    """Bisect the releases of `spec` (or, resuming, those of the saved plan)."""
    if not plan.releases:
        plan.releases = release_range(spec)
        plan.save(run_dir)
    return ReleaseBisection(plan, run_dir).run()
