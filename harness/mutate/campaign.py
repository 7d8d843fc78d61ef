"""A mutation campaign: its plan (campaign.json), one JSON line per judged mutant (mutants.jsonl), and the
procedure for one mutant: write it into the tree, build, take it out, meet the battery.

Statuses: `stillborn` (it does not compile), `killed` (a suite failed on it, confirmed by serving the failing cell
again; a timeout is a kill), `survived` (every suite of both stages passed), `unconfirmed` is not a status but a
kill that did not show twice (the mutant goes on to the next suite), `error` (the harness could not judge it: never
a kill). A campaign is resumed from its directory: judged mutants are not judged again.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness import interrupt
from harness.backends.build import BuildInfo, ensure_server, source_identity, vendored_source, work_dir
from harness.errors import HarnessError
from harness.mutate import coverage, peers
from harness.mutate.battery import SuiteRun, require_clean_pass, run_suite, server_cells, timeout_for
from harness.mutate.generate import Mutant
from harness.mutate.tree import MutationTree
from harness.paths import append_jsonl, cache_dir, read_jsonl
from harness.verdict.noise import hardware

PLAN_FILE = "campaign.json"
RESULTS_FILE = "mutants.jsonl"
STILLBORN, KILLED, SURVIVED, ERROR = "stillborn", "killed", "survived", "error"
UNREACHED = "no run of the battery executes its line (line coverage of the unmutated build): built, not served"


VENDORED = "vendored"
"""`Campaign.source` of a campaign of the vendored tree (and "tag" of one of `tag`'s): found again on whatever machine
resumes it, so a campaign's files carry no path of this machine and a campaign can go on elsewhere."""
TAGGED = "tag"


@dataclass
class Campaign:
    source: str
    """VENDORED, TAGGED (the tree of `tag`) or the path of a tree given with --source."""
    identity: str
    targets: list[str]
    seed: int
    sample: int | None
    pool_size: int
    mutants: list[dict]
    stage1: list[str]
    stage2: list[str]
    tag: str = ""
    peers: bool = True
    """Also run llama.cpp's own server tests of speculation on each compiled mutant (harness/mutate/peers.py)."""
    coverage: bool = True
    """Measure which lines the battery executes first: a mutant on an executable line none executes survives
    unserved (built: it may not compile; harness/mutate/coverage.py)."""
    clean: dict[str, dict] = field(default_factory=dict)
    """suite -> the unmutated build's run of it (exit, seconds): on this machine and build (`clean_on`)."""
    clean_on: str = ""
    """The machine and unmutated build `clean` was measured on (`Judge.machine`): a campaign resumed on another
    machine, or after the unmutated build was rebuilt, serves the unmutated build again before any mutant."""
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    def save(self, run_dir: Path) -> None:
        tmp = run_dir / (PLAN_FILE + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        tmp.replace(run_dir / PLAN_FILE)

    @classmethod
    def load(cls, run_dir: Path) -> Campaign:
        path = Path(run_dir) / PLAN_FILE
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            raise HarnessError(f"{run_dir} holds no campaign ({PLAN_FILE}): give a directory `mutate` wrote") from None
        except (OSError, ValueError, TypeError) as err:
            raise HarnessError(f"{path} is not a campaign file ({' '.join(str(err).split())})") from None

    def sampled(self) -> list[Mutant]:
        return [Mutant.from_json(m) for m in self.mutants]

    def tree_source(self) -> Path:
        """The tree the campaign mutates on this machine; a HarnessError when its bytes are not the campaign's."""
        if self.source == TAGGED:
            from harness.backends.build.tags import resolve_tag, tag_source

            source = tag_source(resolve_tag(self.tag))
        else:
            source = vendored_source() if self.source == VENDORED else Path(self.source)
        if not (source / "CMakeLists.txt").is_file():
            raise HarnessError(f"the campaign's llama.cpp tree {source} is gone: a campaign judges one tree")
        if str(source_identity(source)) != self.identity:
            raise HarnessError(
                f"the campaign's llama.cpp tree {source} is not the one it sampled ({self.identity}): a campaign "
                "judges one tree; start another"
            )
        return source


def read_results(run_dir: Path) -> list[dict]:
    """Every judged mutant, oldest first (a line cut short by a kill is ignored)."""
    return read_jsonl(Path(run_dir) / RESULTS_FILE)


def append_result(run_dir: Path, record: dict) -> None:
    with interrupt.deferred():  # a judged mutant is logged whole (what --resume goes on from)
        append_jsonl(Path(run_dir) / RESULTS_FILE, record)


class Judge:
    """Judges mutants of one campaign in one mutation tree; the unmutated build's runs are made once, when a suite
    is first needed, and kept in the plan."""

    def __init__(self, campaign: Campaign, run_dir: Path, tree: MutationTree, keep_builds: bool = False):
        self.campaign, self.run_dir, self.tree, self.keep_builds = campaign, run_dir, tree, keep_builds
        self.clean_build = ensure_server(source=tree.path)
        machine = self.machine()
        if campaign.clean_on != machine:  # another machine or a rebuilt build: measured again here
            campaign.clean, campaign.clean_on = {}, machine
            campaign.save(run_dir)
        self.peer_tests = peers.stage(tree.path, run_dir) if campaign.peers else None
        self._reach: dict | None = None

    def machine(self) -> str:
        """This machine's processor and cores, and when the unmutated build was made."""
        made = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(self.clean_build.server_bin.stat().st_mtime))
        return f"{hardware(self.clean_build.backend)} x{os.cpu_count()}, unmutated llama-server built {made}"

    def clean_run(self, suite: str) -> dict:
        if suite not in self.campaign.clean:
            print(f"mutate: the unmutated build on {suite} (once)", flush=True)
            run = run_suite(suite, self.clean_build.server_bin, self.run_dir / "clean" / suite, None)
            require_clean_pass(run)
            self.campaign.clean[suite] = run.to_json()
            self.campaign.save(self.run_dir)
        return self.campaign.clean[suite]

    def quickest_first(self, suites: list[str]) -> list[str]:
        """`suites` by the unmutated build's time on each, quickest first (each measured once): a mutant that one
        of them kills is killed sooner on average; the order changes no verdict."""
        return sorted(suites, key=lambda s: (self.clean_run(s)["seconds"], s)) if suites else []

    def _peers_reach(self, mutant: Mutant) -> bool:
        return self.peer_tests is not None and self.reached(mutant, "peers")

    def clean_peers(self) -> dict:
        if "peers" not in self.campaign.clean:
            print("mutate: the unmutated build on llama.cpp's own server tests (once)", flush=True)
            run = peers.run_peers(self.peer_tests, self.clean_build.server_bin, self.run_dir / "clean" / "peers", None)
            if not run["passed"]:
                raise HarnessError(
                    f"llama.cpp's server tests pass nothing on the unmutated build (log: {self.run_dir}/clean/"
                    "peers.log): run the campaign without them (--no-peers)"
                )
            self.campaign.clean["peers"] = run
            self.campaign.save(self.run_dir)
        return self.campaign.clean["peers"]

    def reach(self) -> dict:
        """{"ours": file -> {executable, covered}, "peers": ..., "suites": suite -> file -> covered, "cells":
        suite -> cell id -> file -> covered}: measured once (coverage.json in the campaign; one measured before
        coverage was kept per cell is measured again)."""
        if self._reach is None:
            path = self.run_dir / coverage.FILE
            if path.is_file() and "cells" not in json.loads(path.read_text()):
                print("mutate: the campaign's coverage has no per-cell lines; measuring it again", flush=True)
                path.unlink()
            if not path.is_file():
                self._measure_coverage(path)
            self._reach = json.loads(path.read_text())
        return self._reach

    def _measure_coverage(self, path: Path) -> None:
        files = sorted({m["file"] for m in self.campaign.mutants})
        print(f"mutate: line coverage of {', '.join(files)} over the battery (once)", flush=True)
        interrupt.phase("building")
        info, tree_dir = coverage.build(self.tree.path)
        base = self.run_dir / "coverage"
        shutil.rmtree(base, ignore_errors=True)
        by_suite, by_cell = {}, {}
        for suite in [*self.campaign.stage1, *self.campaign.stage2]:
            interrupt.phase("serving")
            env = coverage.cell_counter_env(base / "suites" / suite)  # each suite's and each cell's counters apart
            run_suite(suite, info.server_bin, base / "runs" / suite, None, env=env)  # its verdicts do not matter
            measured = coverage.read_cells(base / "suites" / suite, tree_dir, self.tree.path, files)
            by_suite[suite] = coverage.union(measured.values())
            by_cell[suite] = {cell: {f: r["covered"] for f, r in lines.items()} for cell, lines in measured.items()}
        reach = {"ours": coverage.union(by_suite.values()), "peers": {}, "cells": by_cell}
        reach["suites"] = {suite: {f: lines["covered"] for f, lines in r.items()} for suite, r in by_suite.items()}
        if self.peer_tests is not None:
            env = coverage.counter_env(base / "peers")
            peers.run_peers(self.peer_tests, info.server_bin, base / "runs" / "peers", None, env)
            reach["peers"] = coverage.read(base / "peers", tree_dir, self.tree.path, files)
        with interrupt.deferred():
            path.write_text(json.dumps(reach) + "\n")

    def reached(self, mutant: Mutant, whose: str = "ours") -> bool:
        """False only when `whose` runs never execute the mutant's line and gcov lists it as executable."""
        lines = self.reach()[whose].get(mutant.file)
        return lines is None or mutant.line not in lines["executable"] or mutant.line in lines["covered"]

    def cells_to_serve(self, mutant: Mutant, suite: str) -> list[str] | None:
        """The cells of `suite` the mutant must meet (harness.mutate.coverage.cells_to_serve): None for every
        cell (coverage off, a line gcov does not list as executable, a suite not measured), [] when no cell of the
        suite executes its line (the suite serves what it served unmutated)."""
        if not self.campaign.coverage:
            return None
        lines = self.reach()["ours"].get(mutant.file)
        per_cell = self.reach()["cells"].get(suite)
        if lines is None or mutant.line not in lines["executable"] or per_cell is None:
            return None
        executing = {cell for cell, files in per_cell.items() if mutant.line in files.get(mutant.file, [])}
        every = server_cells(suite)
        chosen = coverage.cells_to_serve(executing, every, set(per_cell))
        return None if len(chosen) == len(every) else chosen

    def judge(self, mutant: Mutant) -> dict:
        """Build `mutant` and meet the battery; its record (also when it is stillborn)."""
        text = (self.tree.source / mutant.file).read_text(errors="surrogateescape")
        record = {**mutant.to_json(), "diff": mutant.diff(text), "runs": [], "unconfirmed": []}
        started = time.monotonic()
        build = self._build(mutant, record)  # also an unreached one: a mutant that does not compile is stillborn
        if build is not None:
            try:
                if not self.campaign.coverage or self.reached(mutant):
                    self._battery(mutant, build, record)
                else:  # no run executes its line: served, it would pass every suite
                    record.update(status=SURVIVED, reached=False, reason=UNREACHED)
                if self.peer_tests is None or record["status"] == ERROR:
                    pass
                elif not self.campaign.coverage or self._peers_reach(mutant):
                    record["peers"] = self._peers(mutant, build)
                else:
                    record["peers"] = {"killed": False, "reached": False, "failed": [], "seconds": 0.0}
            finally:
                self._drop(build)
        record["seconds"] = round(time.monotonic() - started, 1)
        return portable(record, self.tree.path, self.run_dir)

    def _build(self, mutant: Mutant, record: dict) -> BuildInfo | None:
        started = time.monotonic()
        with self.tree.applied(mutant):  # the tree is clean again before any suite runs
            interrupt.phase("mutating")  # the mutant is in the tree (tests interrupt here)
            try:
                build = ensure_server(source=self.tree.path)
            except HarnessError as err:
                if not str(err).startswith("llama.cpp build failed"):  # configuring, a lock, the disk: not the mutant
                    raise
                build = None
                record.update(status=STILLBORN, reason=_compile_error(str(err)))
        record["build_s"] = round(time.monotonic() - started, 1)
        return build

    def _battery(self, mutant: Mutant, build: BuildInfo, record: dict) -> None:
        for stage in (1, 2):
            every = self.campaign.stage1 if stage == 1 else self.quickest_first(self.campaign.stage2)
            plan = {suite: self.cells_to_serve(mutant, suite) for suite in every}
            suites = [suite for suite in every if plan[suite] != []]
            if len(suites) < len(every):
                record.setdefault("unreached_suites", []).extend(s for s in every if s not in suites)
            clean = {suite: self.clean_run(suite) for suite in suites}  # once per campaign, not the mutant's time
            stage_started = time.monotonic()
            for suite in suites:
                out = self.run_dir / "runs" / mutant.id / suite
                interrupt.phase("serving")
                run = run_suite(
                    suite, build.server_bin, out, timeout_for(clean[suite]["seconds"]), cell_ids=plan[suite]
                )
                record["runs"].append({**run.to_json(), **({"cells": plan[suite]} if plan[suite] else {})})
                if run.error:
                    record.update(status=ERROR, reason=f"{suite}: {run.error}", stage=stage)
                    return
                if run.kill and self._confirmed(run, build, out):
                    record.update(status=KILLED, stage=stage, suite=suite, **run.kill)
                    record[f"stage{stage}_s"] = round(time.monotonic() - stage_started, 1)
                    return
                if run.kill:
                    record["unconfirmed"].append({"suite": suite, **run.kill})
                shutil.rmtree(out, ignore_errors=True)  # a passed run's files say nothing the record does not
            record[f"stage{stage}_s"] = round(time.monotonic() - stage_started, 1)
        record["status"] = SURVIVED

    def _peers(self, mutant: Mutant, build: BuildInfo) -> dict:
        """llama.cpp's own tests on the mutant: the ones that pass on the unmutated build and fail here."""
        clean = self.clean_peers()
        interrupt.phase("serving")
        run = peers.run_peers(
            self.peer_tests, build.server_bin, self.run_dir / "runs" / mutant.id / "peers", peers.timeout_for(clean)
        )
        failed = peers.peer_kill(clean, run)
        return {"killed": bool(failed), "failed": failed, "exit": run["exit"], "seconds": run["seconds"]}

    def _confirmed(self, run: SuiteRun, build: BuildInfo, out: Path) -> bool:
        """A kill holds when serving its cell again fails again (a timeout is not served twice)."""
        if run.kill["cell"] is None:
            return True
        again = run_suite(
            run.suite, build.server_bin, out.with_name(out.name + "-again"), run.seconds * 4 + 120, run.kill["cell"]
        )
        run.kill["confirmed_by"] = again.kill["signature"] if again.kill else None
        return again.kill is not None

    def _drop(self, build: BuildInfo) -> None:
        """Remove a mutant's build from the cache (it is rebuilt from its diff in a minute if wanted)."""
        root = build.server_bin.parent.parent
        if self.keep_builds or root == self.clean_build.server_bin.parent.parent:
            return
        shutil.rmtree(root, ignore_errors=True)
        Path(str(root) + ".lock").unlink(missing_ok=True)


def _compile_error(message: str) -> str:
    """The compiler's first error line of a failed build's message (else its first line)."""
    lines = message.splitlines()
    return next((line.strip() for line in lines if "error:" in line), lines[0] if lines else "build failed")[:300]


def portable(record, tree: Path, run_dir: Path):
    """`record` with the paths of this machine made relative: a file of the tree (as the compiler and llama-server
    name it: the tree, or its link at the build's work path) by its path in the tree, a file of the campaign by its
    path in the campaign's directory, any other file of the cache (a failed build's log) as `<cache>/...`. A
    campaign's files name no path of the machine that wrote them."""
    work = (work_dir() / "src", work_dir().resolve() / "src", tree, tree.resolve(), run_dir)
    prefixes = [(f"{p}/", "") for p in work] + [
        (f"{cache_dir()}/", "<cache>/"),
        (f"{cache_dir().resolve()}/", "<cache>/"),
    ]
    if isinstance(record, dict):
        return {k: portable(v, tree, run_dir) for k, v in record.items()}
    if isinstance(record, list):
        return [portable(v, tree, run_dir) for v in record]
    if isinstance(record, str):
        return functools.reduce(lambda text, p: text.replace(*p), prefixes, record)
    return record
