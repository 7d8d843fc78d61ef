"""Driving `git bisect run` in a llama.cpp checkout, safely, resumably.

Order of work: refuse a checkout that is not clean or already bisecting; `git bisect start`; judge the
bad and the good commit first (the bad one first: its failure is the one pinned; each must give its verdict,
else the bisect stops and says why); mark
them, replay the verdicts of an interrupted run's log (`--resume`), then `git bisect run` with our step;
judge the first bad commit's parent when no step did. Whatever happens (an error, Ctrl-C, SIGTERM, SIGHUP:
harness.interrupt makes each a KeyboardInterrupt), `git bisect reset` ends it and the checkout is back on
the branch or commit it started on.

Steps run in their own process group, so an interrupt reaches the driver alone, which then stops the
step (its build, its llama-server) and waits for it before resetting the checkout.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import harness
from harness.bisect.git import Git
from harness.bisect.plan import Plan
from harness.bisect.result import Outcome, Stop
from harness.bisect.step import read_log
from harness.errors import HarnessError
from harness.verdict.outcome import BAD, GOOD, SKIP

GIT_LOG = "git-bisect.log"
STOP_GRACE_S = 60.0
"""How long an interrupted step may take to stop its build and server before it is killed."""
FIRST_BAD = re.compile(r"^([0-9a-f]{40}) is the first bad commit", re.M)
ONLY_SKIPPED = "There are only 'skip'ped commits left to test."


def step_command(run_dir: Path, role: str) -> list[str]:
    return [sys.executable, "-m", "harness.bisect.step", str(run_dir), "--role", role]


def step_env() -> dict:
    """The step imports this very harness, whatever the checkout's directory has on sys.path."""
    env = dict(os.environ)
    root = str(Path(harness.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_group(cmd: list[str], cwd: Path, stdout) -> int:
    """Run `cmd` in a process group of its own; on an interrupt stop the whole group, then re-raise."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=step_env(), stdout=stdout, stdin=subprocess.DEVNULL, start_new_session=True
    )
    try:
        return proc.wait()
    except BaseException:
        stop_group(proc)
        raise


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, wait for every member to exit, SIGKILL what is left after the grace."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
        deadline = time.monotonic() + grace
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            proc.wait()
            return
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, else the group lives on as a zombie
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


@contextmanager
def bisect_session(git: Git, original: str):
    """`git bisect start` ... always `git bisect reset`, back to `original` (a branch ref or a commit)."""
    git("bisect", "start")
    try:
        yield
    finally:
        _reset(git, original)


def _reset(git: Git, original: str) -> None:
    git("bisect", "reset", check=False)
    if git.bisecting():  # git was killed mid-checkout and left its lock; nothing of ours runs any more
        (git.git_dir() / "index.lock").unlink(missing_ok=True)
        git("bisect", "reset", check=False)
    if git.head() != original:
        git("checkout", "-q", original.removeprefix("refs/heads/"), check=False)
    where = git.head()
    if git.bisecting() or where != original:
        print(
            f"specharness: warning: could not restore {git.dir} (git bisect reset; now on {where}, "
            f"started on {original})",
            file=sys.stderr,
        )


def check_end(entry: dict, expected: str, what: str) -> None:
    """Stop unless an end of the range gave its expected verdict (`good` for the good end, `bad` for the bad one)."""
    which = "good" if expected == GOOD else "bad"
    if entry["verdict"] == SKIP:
        raise Stop(f"the {which} {what} cannot be judged: {entry['reason']}")
    if entry["verdict"] == expected:
        return
    if which == "good":
        raise Stop(
            f"the good {what} already fails the case ({entry['reason']}): the regression is older, or the "
            "case fails for another reason; nothing to bisect"
        )
    raise Stop(
        f"the bad {what} passes the case: the failure does not reproduce on this cell with this build; "
        "nothing to bisect"
    )


class Bisection:
    """One bisect of a checkout between a good and a bad commit for a plan, logging into `run_dir`."""

    def __init__(self, plan: Plan, run_dir: Path):
        self.plan = plan
        self.run_dir = run_dir
        self.git = Git(Path(plan.source))

    # ---------------------------------------------------------------------------------- steps

    def logged(self, commit: str, roles: tuple[str, ...] | None = None) -> dict | None:
        """The last logged verdict for `commit` (only `roles` when given); errors do not count."""
        found = [
            e
            for e in read_log(self.run_dir)
            if e.get("commit") == commit and e.get("verdict") != "error" and (roles is None or e.get("role") in roles)
        ]
        return found[-1] if found else None

    def judge_commit(self, commit: str, role: str) -> dict:
        """The verdict at `commit`: from the log, else a step run there now."""
        entry = self.logged(commit)
        if entry is not None:
            return entry
        self.git.checkout(commit)
        with open(self.run_dir / GIT_LOG, "a") as out:
            status = run_group(step_command(self.run_dir, role), self.git.dir, out)
        entry = self.logged(commit)
        if entry is None:
            errors = [e for e in read_log(self.run_dir) if e.get("commit") == commit and e.get("verdict") == "error"]
            reason = errors[-1]["reason"] if errors else f"the step exited with status {status} and logged nothing"
            raise HarnessError(f"cannot judge {commit[:10]}: {reason}")
        return entry

    def verify_ends(self) -> None:
        """The bad commit must fail and the good one pass, or there is nothing to bisect. The bad end is judged
        first: the failure it shows is pinned there (when nothing pinned it before), and the good end is judged
        against it like every later step."""
        for role, rev, expected in (("verify-bad", self.plan.bad, BAD), ("verify-good", self.plan.good, GOOD)):
            check_end(self.judge_commit(rev, role), expected, f"commit {rev[:10]}")

    def mark(self, verdict: str, commit: str) -> str:
        """`git bisect good|bad|skip commit`; its output (which names the first bad commit once known)."""
        return self.git("bisect", verdict, commit)

    # ----------------------------------------------------------------------------------- whole

    def run(self) -> Outcome:
        """Verify, replay, `git bisect run`, judge the parent; returns the outcome (Stop when it cannot)."""
        self.verify_ends()
        said = self.mark(GOOD, self.plan.good) + "\n" + self.mark(BAD, self.plan.bad)
        for entry in read_log(self.run_dir):  # --resume: the verdicts an interrupted run already paid for
            if entry.get("role") == "step" and entry.get("verdict") in (GOOD, BAD, SKIP) and not FIRST_BAD.search(said):
                said += "\n" + self.mark(entry["verdict"], entry["commit"])
        if not FIRST_BAD.search(said) and ONLY_SKIPPED not in said:
            said = self._bisect_run()
        found = FIRST_BAD.search(said)
        if not found:
            candidates = re.findall(r"^([0-9a-f]{40})$", said.split(ONLY_SKIPPED)[-1], re.M)
            raise Stop(
                "only commits that cannot be judged are left; the first bad commit is one of "
                + ", ".join(c[:10] for c in candidates),
                candidates=candidates,
            )
        first_bad = found.group(1)
        parent = self.git("rev-parse", f"{first_bad}^")
        return Outcome(
            first_bad=self.git.commit(first_bad),
            parent=self.git.commit(parent),
            first_bad_entry=self.judge_commit(first_bad, "step"),
            parent_entry=self.judge_commit(parent, "parent"),
        )

    def _bisect_run(self) -> str:
        """`git bisect run <step>` from the commit git checked out; returns what it printed."""
        log_path = self.run_dir / GIT_LOG
        start = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "a") as out:
            out.write(f"$ git bisect run {' '.join(step_command(self.run_dir, 'step'))}\n")
            out.flush()
            status = run_group(
                ["git", "-C", str(self.git.dir), "bisect", "run", *step_command(self.run_dir, "step")],
                self.git.dir,
                out,
            )
        with open(log_path) as f:
            f.seek(start)
            said = f.read()
        if status != 0 and not FIRST_BAD.search(said) and ONLY_SKIPPED not in said:
            errors = [e for e in read_log(self.run_dir) if e.get("verdict") == "error"]
            reason = errors[-1]["reason"] if errors else f"git bisect run exited with status {status} (see {log_path})"
            raise HarnessError(f"the bisect stopped: {reason}")
        return said


def prepare_checkout(plan: Plan) -> None:
    """Refuse what cannot be bisected (not a checkout, uncommitted changes, a bisect in progress, unknown or
    unrelated revisions) before anything is written; resolve good and bad to full hashes."""
    git = Git(Path(plan.source))
    git.require_checkout()
    if git.bisecting():
        raise HarnessError(
            f"a git bisect is already in progress in {git.dir}: end it with `git -C {git.dir} bisect reset` first"
        )
    git.require_clean()
    plan.good, plan.bad = git.resolve(plan.good), git.resolve(plan.bad)
    if plan.good == plan.bad or not git.is_ancestor(plan.good, plan.bad):
        raise HarnessError(f"good {plan.good[:10]} is not an ancestor of bad {plan.bad[:10]}")
    plan.original_head = git.head()


def bisect_checkout(plan: Plan, run_dir: Path) -> Outcome:
    """Run (or resume) the bisect of a prepared `plan` in its checkout; the checkout ends where it started."""
    prepare_checkout(plan)
    plan.save(run_dir)
    git = Git(Path(plan.source))
    with bisect_session(git, plan.original_head):  # Ctrl-C, SIGTERM, SIGHUP: harness.interrupt
        return Bisection(plan, run_dir).run()
