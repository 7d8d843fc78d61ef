"""A failing verdict's signature: what makes two failures the same problem, with the run's details gone.

* a crash: the abort line (`GGML_ASSERT(n_ubatch > n_keep_tail) failed`, an uncaught exception's `what()`),
  without the source file, line, paths and numbers (`failed to remove sequence N`), whichever backend
  crashed (llama-server or the in-process engine's worker name it the same way: backends.process);
  without an abort line, how the process ended (`killed by SIGSEGV`);
* a timeout or another error: its message, normalised the same way, without the case it names; a request
  cut off by the restart of a llama-server that another request's timeout stopped restates that timeout;
* a divergence: the check and the triage class (`lossless: hard divergence`);
* a KV cache the scanner found corrupt: the first kind of damage (`kv-healthy: duplicate cells`), also for
  a divergence triaged `kv-corrupt` (which only restates the scan) and for a batch llama.cpp refused because
  of it: one that starts a sequence at a position the KV cache already holds (Y <= X) is the damage the scanner
  finds as duplicate cells where llama.cpp's check does not look (a hybrid memory's last position is its
  recurrent part's), one that skips positions (Y > X + 1) the scanner's holes (backends.base.invalid_batch).
  Such a batch is another request's KV damage showing: where the run has a KV-damage root (a failing
  `kv-healthy` verdict of its own), the refused batch and what restates it fold under it as consequences
  (group.group), in whatever request, case or cell;
* any other check: the check and what failed, without the details (`grammar-valid: invalid output`,
  `acceptance: fell against baseline`, `spec-ran: no drafts at all for the case (N requests)`).

A verdict that only restates another failure of its case and cell takes that failure's signature and is
marked a consequence: a report shows it under that failure, not as another one — only a verdict about the same
request (round) as the failure it restates, where both say which requests they are about. So are a check of a request
that did not complete (`spec-ran: no drafts at all` on a crashed case), a comparison whose reference crashed,
a chat turn not sent because an earlier one failed, a chat turn that reused less of its prompt because the
turn before it left positions past its returned tokens (`prompt-reuse` after `kv-healthy`), the checks of
requests whose KV cache is damaged, and the checks of an output whose divergence another check already reports
(`classify`, ROOTS). A divergence of a request that completed is evidence of its own, whatever else failed.

Works on checks.json records and on `CheckResult`s alike; reads nothing but the verdicts (and, when given,
the results.json records of its case and cell).
"""

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from harness.llama import log as llama_log

CRASH, TIMEOUT, ERROR, DIVERGENCE, CHECK = "crash", "timeout", "error", "divergence", "check"
"""What kind of failure a signature names."""
KV_DAMAGE = (
    ("duplicate_cells", "duplicate cells"),
    ("orphans", "orphans"),
    ("missing_positions", "holes"),
    ("past_returned", "positions past the returned tokens"),
)
"""The KV scanner's kinds of damage (evidence key, name), the most telling first: a signature names the
first one found."""
KV_FINDING = re.compile(r"found (\d+) duplicate \(seq_id, pos\) cells, (\d+) orphans and (\d+) missing positions")
"""A `kv-corrupt` triage reason's findings (checks.base.kv_findings)."""
EXIT = re.compile(r"\b(?:was killed by (?:signal \d+|[A-Z][A-Z0-9]*)|exited with code -?\d+)")
"""How a crashed process ended, as backends.process.describe_exit says it."""
REFUSED_BATCH = re.compile(r"inconsistent sequence positions\).*?\bX = (-?\d+).*?\bY = (-?\d+)")
"""A batch llama.cpp refused, with the sequence's last cached position X and the batch's first Y."""
REFERENCE_FAILED = re.compile(r"reference failed: (.*)", re.S)
"""A comparison whose reference request did not complete (checks.compare.compare_outcome)."""
ASSERT = re.compile(r"(GGML_ASSERT\(.*\)(?: failed)?|GGML_ABORT\(.*\))")
SOURCE = re.compile(r"^\S*\.(?:c|cc|cpp|cu|h|hpp|m|metal):\d+:\s*")
PATH = re.compile(r"(?:[A-Za-z]:)?[\w.+@~-]*[\\/](?:[\w.+@~-]+[\\/])+[\w.+@~-]*|(?<![\w.])/[\w.+@~-]+")
"""A file path: two separators or more, or one leading (`a/b` and `35/41` are no paths)."""
HEX = re.compile(r"\b0x[0-9a-fA-F]+\b")
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w.])")
CASE = re.compile(r"\bcase \S+")
NOT_SENT = re.compile(r" \(so \S+ was not sent\)$")
CUT_OFF = re.compile(r"^cut off: llama-server was restarted because (?=timeout:)")
"""A request llama-server's restart cut off because another request timed out (backends.server_backend)."""
ROUND = re.compile(r"^round (\d+): ")
"""A verdict's failing item of one request (`CheckResult.failures`)."""
"""A later chat turn's error when an earlier turn failed (execute.Executor)."""
LIMIT = 160
SHAPES = {
    "grammar-valid": "invalid output",
    "logits-close": "logits beyond the noise floor",
    "prompt-reuse": "a prompt's cache reuse differs from no speculation",
}
"""Checks whose failure is one thing whatever the details: the signature names only that."""
ROOTS = ("no-crash", "kv-healthy", "lossless", "mode-invariant", "repeat-identical", "baseline")
"""Checks whose failure makes the other failing verdicts of its case and cell (those of checks after it here,
and any other check) its consequences: a crash first, then a damaged KV cache, then a divergence of the output
from the most telling reference (see `classify`)."""
DAMAGE = ("no-crash", "kv-healthy")
"""Roots a divergence (not triaged `kv-corrupt`) does not restate: it is evidence from a request that completed."""
ACCEPTANCE = re.compile(r"against (baseline|seq) \(tolerance [^)]*\): (?:acceptance|accepted tokens)")


@dataclass(frozen=True)
class Signature:
    """A verdict's signature (`text`), what kind of failure it names, and whether the verdict only restates
    another failure (`consequence`: of the crash or error `text` names, or of the KV scan)."""

    text: str
    kind: str
    consequence: bool = False
    refused_batch: bool = False
    """KV damage read from a batch llama.cpp refused (its X and Y), not found by the scanner: the damage of
    another request, which `group` folds under the run's KV-damage root where it has one."""


def normalise(text: str) -> str:
    """A message without what changes from run to run: paths, hex addresses and numbers (`N`); on one line,
    at most LIMIT characters. Numbers inside an assert's condition are code,
    not data, and stay."""
    line = " ".join(text.split())
    kept = ASSERT.search(line)
    head, cond, tail = (line[: kept.start()], kept.group(1), line[kept.end() :]) if kept else (line, "", "")

    def clean(part: str) -> str:
        part = PATH.sub("PATH", part)
        part = HEX.sub("0xH", part)
        return NUMBER.sub("N", part)

    out = (clean(head) + cond + clean(tail)).strip()
    return out if len(out) <= LIMIT else out[: LIMIT - 1] + "…"


def abort_reason(error: str) -> str | None:
    """The telling part of a crash report (backends.process.crash_report): the abort line after `<who> <how
    it ended>: ` without llama.cpp's log prefix (a report written before the harness took it off), the source
    file and line, or, for an uncaught C++ exception, its `what()` from the
    log; None when the report has neither."""
    first = error.split("\n", 1)[0]
    ended = EXIT.search(first)
    rest = (
        re.split(r"; log | \(log: ", first[ended.end() :], maxsplit=1)[0].removeprefix(" during start-up")
        if ended
        else ""
    )
    reason = SOURCE.sub("", llama_log.message(rest.lstrip(":").strip()))
    what = re.search(r"what\(\):\s*(.+)", error)
    if what and (not reason or reason.startswith("terminate called")):
        return what.group(1).strip()
    return reason or None


def of_error(error: str) -> Signature:
    """The signature of a request's (or a cell's) error: a crash, a timeout or another error; a chat turn that
    was not sent because an earlier one failed restates that one's."""
    error = error.strip()
    first = error.split("\n", 1)[0]
    unsent = NOT_SENT.search(first)
    if unsent:
        return _restating(of_error(first[: unsent.start()] + "\n" + error.partition("\n")[2]))
    cut = CUT_OFF.match(first)
    if cut:  # collateral of another request's timeout: that timeout's signature, restated
        return _restating(of_error(first[cut.end() :]))
    if first.startswith("timeout:"):
        return Signature(
            "timeout: " + normalise(CASE.sub("the request", first[len("timeout:") :]).split(";")[0]), TIMEOUT
        )
    ended = EXIT.search(first)
    if ended:
        reason = abort_reason(error)
        return Signature("crash: " + normalise(reason or ended.group(0).replace("was ", "")), CRASH)
    refused = REFUSED_BATCH.search(first)
    if refused and int(refused.group(2)) != int(refused.group(1)) + 1:  # Y = X + 1 says nothing of the cache
        last, start = map(int, refused.groups())
        return Signature(f"kv-healthy: {'duplicate cells' if start <= last else 'holes'}", CHECK, refused_batch=True)
    return Signature("error: " + normalise(CASE.sub("the request", first)), ERROR)


def _as_record(verdict: Any) -> dict:
    """A checks.json record from a record or a CheckResult."""
    if isinstance(verdict, dict):
        return verdict
    return {
        "check": verdict.name,
        "passed": verdict.passed,
        "message": verdict.message,
        "evidence": verdict.evidence,
        "failures": list(getattr(verdict, "failures", None) or []),
    }


def rounds_of(verdict: dict, records: Iterable[dict] = ()) -> set[int] | None:
    """The rounds (requests of its case and cell) a failing verdict is about: from its per-request `failures`
    (`round R: ...`), for `no-crash` without them from the failed requests of `records`; None when it does not
    say (a verdict about the case as a whole)."""
    found = {int(m.group(1)) for line in verdict.get("failures") or [] if (m := ROUND.match(line))}
    if not found and verdict.get("check") == "no-crash":
        rounds = (r.get("repeat", r.get("round")) for r in records if r.get("error"))  # results.json: `repeat`
        found = {int(n) for n in rounds if isinstance(n, int)}
    return found or None


def same_request(verdict: dict, root: dict, records: Iterable[dict] = ()) -> bool:
    """True when `root` failed in a request `verdict` is about (or either does not say which requests)."""
    mine, theirs = rounds_of(verdict, records), rounds_of(root, records)
    return mine is None or theirs is None or bool(mine & theirs)


def _kv_damage(evidence: dict) -> str | None:
    """The first kind of damage in the target's cache, else in the draft model's context (`... in the draft
    context`), None when the evidence names none."""
    found = next((name for key, name in KV_DAMAGE if evidence.get(key)), None)
    draft = evidence.get("draft_context") or {}
    in_draft = next((f"{name} in the draft context" for key, name in KV_DAMAGE if draft.get(key)), None)
    return found or in_draft


def _first_error(verdict: dict, records: Iterable[dict]) -> str | None:
    """The error no-crash reports: from its message (`... round R: <error>` / `the cell could not be served:
    <error>`, the whole error with its log tail), else the case's first crashed (or timed-out) request's, else
    its first failed one's."""
    found = re.search(r"(?:round \d+|could not be served): (.*)", verdict.get("message") or "", re.S)
    if found:
        return found.group(1).split("\n  reproduce: ")[0]
    failed = [r for r in records if r.get("error")]
    first = next((r for r in failed if r.get("stop_reason") in ("crashed", "timeout")), failed[0] if failed else None)
    return first["error"] if first else None


def classify(verdict: Any, records: Iterable[dict] = (), siblings: Iterable[Any] = ()) -> Signature:
    """The signature of a failing verdict (a checks.json record or a CheckResult).

    `records`: the results.json records of its case and cell (they name the error where a `no-crash` message
    does not); `siblings`: the failing verdicts of that case and cell. The first failing one in ROOTS order
    before this verdict's check makes it a consequence of that one: of a crash or an error, or of a damaged
    KV cache (the outputs, logits and acceptance of its requests are no evidence of anything else) — except a
    divergence not triaged `kv-corrupt`, which is evidence of its own —, or of a divergence of the same
    output (`baseline` after `lossless`; an invalid grammar or an acceptance drop of an output that already
    diverged). A root restates only a verdict about the same request (`same_request`: a KV finding of a request
    that completed is no consequence of another request's crash)."""
    v = _as_record(verdict)
    records = list(records)
    own = _own(v, records)
    if own.consequence:
        return own
    rank = ROOTS.index(v["check"]) if v["check"] in ROOTS else len(ROOTS)
    roots = {
        s["check"]: s
        for s in map(_as_record, siblings)
        if not s.get("passed") and s["check"] in ROOTS[:rank] and same_request(v, s, records)
    }
    for name in ROOTS[:rank]:
        if name in roots and not (name in DAMAGE and own.kind == DIVERGENCE):
            return _restating(classify(roots[name], records, siblings))
    return own


def _own(v: dict, records: list[dict]) -> Signature:
    """A verdict's signature from its own evidence (a consequence only where that evidence says so: a
    reference that failed, a divergence triaged `kv-corrupt`, a chat turn not sent)."""
    check, message, evidence = v["check"], v.get("message") or "", v.get("evidence") or {}
    first = evidence.get("first_divergence")
    if check == "no-crash":
        error = _first_error(v, records)
        return of_error(error) if error else Signature("no-crash: " + normalise(message.split("\n")[0]), ERROR)
    if check == "kv-healthy" and _kv_damage(evidence):
        return Signature(f"kv-healthy: {_kv_damage(evidence)}", CHECK)
    if isinstance(first, dict) and first.get("kind"):
        if first["kind"] == "kv-corrupt":
            found = KV_FINDING.search(first.get("reason") or "")
            if found:
                counts = dict(
                    zip(("duplicate_cells", "orphans", "missing_positions"), map(int, found.groups()), strict=False)
                )
                if _kv_damage(counts):
                    return Signature(f"kv-healthy: {_kv_damage(counts)}", CHECK, consequence=True)
        return Signature(f"{check}: {first['kind']} divergence", DIVERGENCE)
    reference = REFERENCE_FAILED.search(message)
    if reference:
        return _restating(of_error(reference.group(1).split("\n  reproduce: ")[0]))
    if check == "prompt-reuse" and evidence.get("left_behind"):  # the previous turn's kv-healthy finding
        return _restating(Signature(f"kv-healthy: {dict(KV_DAMAGE)['past_returned']}", CHECK))
    return Signature(f"{check}: {_shape(v)}", CHECK)


def _shape(verdict: dict) -> str:
    """What a check's failure is, without the case, the cell or the numbers: its SHAPES entry, what fell
    against what for `acceptance`, else its message's first clause without the verdict's own cell and case."""
    check, message = verdict["check"], verdict.get("message") or ""
    if check in SHAPES:
        return SHAPES[check]
    fell = ACCEPTANCE.search(message)
    if check == "acceptance" and (fell or "no acceptance baseline" in message):
        return f"fell against {fell.group(1)}" if fell else "no acceptance baseline"  # the rate or the count
    first = message.split("\n")[0].split("; ")[0]
    if all(k in verdict for k in ("mode", "spec", "model", "backend")):
        first = first.replace(f"{verdict['mode']}-{verdict['spec']}-{verdict['model']}-{verdict['backend']}", "CELL")
        first = first.replace(f"{verdict['mode']}/{verdict['spec']}", "MODE/SPEC")
    if verdict.get("case"):
        first = re.sub(rf"(?<![\w.-]){re.escape(verdict['case'])}(?![\w.-])", "CASE", first)
    return normalise(first)


def _restating(root: Signature) -> Signature:
    return replace(root, consequence=True)


def signature_of(verdict: Any, records: Iterable[dict] = (), siblings: Iterable[Any] = ()) -> str:
    """The signature text of a failing verdict (see `classify`)."""
    return classify(verdict, records, siblings).text
