"""`repro.sh`: the failing case against llama-server with nothing but bash and curl.

It starts each leg's exact llama-server command line on a free loopback port, sends the exact /completion
bodies (prompts as token ids, from `requests/`) the way they were sent (one at a time, or a batch at once,
waiting for that batch's requests only), prints expected against actual and exits with (EXIT_CODES):

- 1 REPRODUCED: the same signature: a crash with the same abort line (or, without one, the same signal), a
  timeout of the request, an error with the same message, a KV scan with the same first kind of damage, an
  output that first diverges at the same generated token, rounds that differ;
- 3 a different failure: the subject failed otherwise (llama-server still answers where it crashed, an
  HTTP error or a curl timeout where it aborted, another abort line, another kind of KV damage, a divergence
  at another token, any failure where the outputs were compared);
- 0 not reproduced: every request completed and the judge found nothing;
- 2 could not tell: llama-server did not start, the reference leg failed, no scanner for the KV verdict.

An intermittent failure is run up to N times (`attempt`, each a fresh llama-server; N from the rate measured when
the bundle was written: harness.repro.rate.retries and retry_loop), stopping at the first run that reproduces it ("reproduced k of
n"); it says "not reproduced" only after N clean runs. `$REPRO_RUNS` sets N, `$REPRO_ALL=1` runs all N (counting
the rate).

`$LLAMA_SERVER`, `$MODEL` and `$DRAFT_MODEL` replace the run's binary and models; `$REQUEST_TIMEOUT` (seconds,
default 120) bounds each request.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
from pathlib import Path

from harness.repro.legs import JUDGES, REFERENCE, SUBJECT
from harness.repro.rate import retry_loop
from harness.suites import RESTORE_ROUNDS
from harness.verdict.signature import EXIT, KV_DAMAGE, abort_reason

NOT_REPRODUCED, REPRODUCED, UNDECIDED, DIFFERENT = 0, 1, 2, 3
EXIT_CODES = {
    REPRODUCED: "the failure reproduces (the same signature)",
    DIFFERENT: "a different failure",
    NOT_REPRODUCED: "it does not reproduce",
    UNDECIDED: "it could not be told",
}

HELPERS = r"""
WORK="$(mktemp -d)"
PID=""
OTHER_PID=""  # a restore-fresh round's other llama-server (see use_server)
cleanup() {
  local p
  for p in "$PID" "$OTHER_PID"; do
    if [ -n "$p" ]; then kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; fi
  done
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
  local port
  while :; do
    port=$((20000 + RANDOM % 40000))
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || { echo "$port"; return; }
  done
}

start_server() {  # LEG ARGS...: start llama-server and wait until /health answers (its log: $WORK/LEG.log)
  local leg="$1"; shift
  local try
  LOG_OF="$leg"
  for try in 1 2 3 4 5; do  # another process may take the free port before llama-server binds it
    PORT="$(free_port)"
    echo "\$ $LLAMA_SERVER --host 127.0.0.1 --port $PORT $*"
    "$LLAMA_SERVER" --host 127.0.0.1 --port "$PORT" "$@" >"$WORK/$leg.log" 2>&1 &
    PID=$!
    for _ in $(seq 1 600); do
      if ! kill -0 "$PID" 2>/dev/null; then
        wait "$PID" 2>/dev/null; PID=""
        if grep -q "couldn't bind HTTP server socket" "$WORK/$leg.log"; then continue 2; fi
        echo "llama-server exited during start-up:"; startup_said "$leg"; exit 2
      fi
      if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then return 0; fi
      sleep 0.1
    done
    echo "llama-server did not answer /health within 60 s"; exit 2
  done
  echo "llama-server could not bind a free loopback port in 5 tries:"; tail -n 5 "$WORK/$leg.log"; exit 2
}

stop_server() {
  kill "$PID" 2>/dev/null; wait "$PID" 2>/dev/null; PID=""
}

ON=main
use_server() {  # main|fresh: the llama-server the next requests go to (a restore-fresh round's fresh one, or not)
  if [ "$1" = "$ON" ]; then return; fi
  local pid="$PID" port="${PORT:-}" log="${LOG_OF:-}"
  PID="$OTHER_PID"; PORT="${OTHER_PORT:-}"; LOG_OF="${OTHER_LOG:-}"
  OTHER_PID="$pid"; OTHER_PORT="$port"; OTHER_LOG="$log"; ON="$1"
}

slot_action() {  # ROLE SLOT ACTION [FILE]: POST /slots/SLOT?action=ACTION (save, erase, restore; FILE in $WORK)
  local body='{}'
  if [ -n "${4:-}" ]; then body="{\"filename\": \"$4\"}"; fi
  local code
  code="$(curl -s -o "$WORK/slot-$3.json" -w '%{http_code}' --max-time "$REQUEST_TIMEOUT" -X POST \
    -H 'Content-Type: application/json' -d "$body" "http://127.0.0.1:$PORT/slots/$2?action=$3" 2>/dev/null)"
  echo "POST /slots/$2?action=$3 ${4:-}: HTTP $code $(head -c 200 "$WORK/slot-$3.json" 2>/dev/null)"
  if [ "$code" = 200 ]; then return 0; fi
  if [ "$1" != subject ]; then echo "the $1 leg's slot $3 failed"; exit 2; fi
  DIED=""; STATUS=""; ROLE="$1"
  if ended 10; then DIED=1; fi
  if [ -n "$DIED" ]; then subject_failed; fi
  different "POST /slots/$2?action=$3: HTTP $code"
}

counts_of() {  # NAME: "drafted accepted" of an answer (llama-server leaves them out when nothing was drafted)
  local n a
  n="$(grep -o '"draft_n": *[0-9]*' "$WORK/$1.json" 2>/dev/null | head -n 1 | grep -o '[0-9]*$')"
  a="$(grep -o '"draft_n_accepted": *[0-9]*' "$WORK/$1.json" 2>/dev/null | head -n 1 | grep -o '[0-9]*$')"
  echo "${n:-0} ${a:-0}"
}

post() {  # NAME: send requests/NAME.json to /completion; the answer goes to $WORK/NAME.json, its HTTP status to NAME.code
  curl -s -o "$WORK/$1.json" -w '%{http_code}' --max-time "$REQUEST_TIMEOUT" -H 'Content-Type: application/json' \
    --data-binary "@$HERE/requests/$1.json" "http://127.0.0.1:$PORT/completion" >"$WORK/$1.code" 2>/dev/null
  echo $? >"$WORK/$1.rc"
}

code_of() { cat "$WORK/$1.code" 2>/dev/null || echo 000; }

timed_out() { [ "$(cat "$WORK/$1.rc" 2>/dev/null)" = 28 ]; }  # curl: operation timed out

message_of() {  # NAME: the error message of an answer, numbers as N
  grep -o '"message":"[^"]*"' "$WORK/$1.json" 2>/dev/null | head -n 1 | sed -e 's/^"message":"//' -e 's/"$//' \
    | sed -E 's/[0-9]+/N/g'
}

ended() {  # [TENTHS]: true when llama-server is gone (waiting up to TENTHS/10 s, default 5 s, for a dying one);
  # its exit status in STATUS
  local _
  for _ in $(seq 1 "${1:-50}"); do
    if ! kill -0 "$PID" 2>/dev/null; then wait "$PID" 2>/dev/null; STATUS=$?; PID=""; return 0; fi
    sleep 0.1
  done
  return 1
}

judge_batch() {  # ROLE NAME...: after a batch: when a request failed or the server died, the verdict
  local role="$1"; shift
  local name failed=""
  for name in "$@"; do
    if [ "$(code_of "$name")" != 200 ]; then failed="$failed $name"; fi
  done
  if [ -z "$failed" ] && kill -0 "$PID" 2>/dev/null; then return 0; fi
  DIED=""; STATUS=""; ROLE="$role"
  for name in ${failed:-none}; do
    if [ "$name" = none ] || [ "$(code_of "$name")" = 000 ]; then ended && DIED=1; break; fi
  done
  if [ -z "$DIED" ] && ended 10; then DIED=1; fi  # an HTTP error answered just before llama-server died
  if [ "$role" != subject ]; then
    echo "the $role leg did not complete: $(describe_failure $failed)"; exit 2
  fi
  subject_failed $failed
}

describe_failure() {  # NAME...: what went wrong, in one line
  if [ -n "$DIED" ]; then echo "llama-server ended (exit status $STATUS): $(abort_line "$LOG_OF")"; return; fi
  local name="$1"
  if timed_out "$name"; then echo "$name got no answer within $REQUEST_TIMEOUT s (llama-server still runs)"; return; fi
  echo "$name: HTTP $(code_of "$name"): $(message_of "$name")"
}

tokens_of() {  # NAME: the generated token ids of an answer, space-separated
  grep -o '"tokens": *\[[^]]*\]' "$WORK/$1.json" 2>/dev/null | head -n 1 | sed -e 's/"tokens": *\[//' -e 's/\]//' -e 's/,/ /g'
}

unprefixed() {  # stdin: llama-server's log lines without llama.cpp's `M.SS.mmm.uuu L ` prefix and colours (bytes
  # as they are: at -lv 5 the log holds raw token bytes)
  LC_ALL=C sed -E -e 's/\x1b\[[0-9;]*m//g' -e 's/^[0-9]+\.[0-9]{2}\.[0-9]{3}\.[0-9]{3} ([IWED] )?//'
}

LOG_ERROR='^[0-9]+\.[0-9]{2}\.[0-9]{3}\.[0-9]{3} E '  # a line logged at level error

abort_line() {  # LEG: the line of the server log that says why it stopped, most telling first, else its last error
  local pattern
  for pattern in 'GGML_ASSERT|GGML_ABORT' 'what\(\):|terminate called' '\.(cpp|c|h):[0-9]+: ' 'Segmentation'; do
    if unprefixed <"$WORK/$1.log" | LC_ALL=C grep -a -m 1 -E "$pattern"; then return; fi
  done
  if LC_ALL=C grep -aqE "$LOG_ERROR" "$WORK/$1.log"; then
    LC_ALL=C grep -aE "$LOG_ERROR" "$WORK/$1.log" | tail -n 1 | unprefixed
  else
    unprefixed <"$WORK/$1.log" | tail -n 1
  fi
}

startup_said() {  # LEG: why llama-server ended during start-up: its last abort and error lines, else its last lines
  local lines="GGML_ASSERT|GGML_ABORT|what\\(\\):|terminate called|$LOG_ERROR"
  if LC_ALL=C grep -aqE "$lines" "$WORK/$1.log"; then
    LC_ALL=C grep -aE "$lines" "$WORK/$1.log" | tail -n 5 | unprefixed
  else
    unprefixed <"$WORK/$1.log" | tail -n 5
  fi
}

same_abort() {  # LEG TEXT: the log holds the abort line TEXT (numbers as N); without TEXT, llama-server's exit status
  if [ -n "$2" ]; then
    unprefixed <"$WORK/$1.log" | LC_ALL=C sed -E 's/[0-9]+/N/g' | LC_ALL=C grep -aqF -- "$2"
  else
    [ "$STATUS" = "$EXPECTED_STATUS" ]
  fi
}

reproduced() { echo "REPRODUCED: $*"; exit 1; }
different() { echo "DIFFERENT FAILURE (not the signature: $SIGNATURE): $*"; exit 3; }

first_difference() {  # "A" "B": index of the first differing token (or the shorter length)
  local -a a=($1) b=($2)
  local i=0
  while [ $i -lt ${#a[@]} ] && [ $i -lt ${#b[@]} ] && [ "${a[$i]}" = "${b[$i]}" ]; do i=$((i + 1)); done
  echo "$i"
}
"""


def write(bundle: Path, case: dict, defaults: dict[str, str]) -> Path:
    """Write `repro.sh` and its `requests/` into `bundle` for the legs of `case` (case.json's content);
    `defaults` maps LLAMA_SERVER / MODEL / DRAFT_MODEL to the run's files."""
    requests_dir = bundle / "requests"
    requests_dir.mkdir(parents=True, exist_ok=True)
    judge, key = case["judge"], case["key"]
    lines = [
        "#!/usr/bin/env bash",
        f"# Reproducer written by specharness: {case['signature']}",
        f"# case {case['suite']}[{key}], {case['cell_id']}; judge: {JUDGES[judge]}.",
        "# Exit status: " + ", ".join(f"{code} {what}" for code, what in EXIT_CODES.items()) + ".",
        "# Same signature: " + SAME[judge] + ".",
        "set -u",
        'HERE="$(cd "$(dirname "$0")" && pwd)"',
    ]
    for name, value in defaults.items():
        lines.append(f'{name}="${{{name}:-{value}}}"')
    lines += ['REQUEST_TIMEOUT="${REQUEST_TIMEOUT:-120}"', 'SPECHARNESS="${SPECHARNESS:-specharness}"']
    lines += ["", "attempt() {  # one run of the case; its exit status is the verdict (EXIT_CODES)", HELPERS]
    targets: dict[str, list[str]] = {}
    body: list[str] = []
    for leg in case["legs"]:
        role = leg["role"]
        body += [f'echo "== {role}: {leg["cell_id"]}"', "start_server " + role + " " + _argv(leg["command"])]
        scanned = role == SUBJECT and judge == "kv"
        last = (
            [
                f"{role}-{b}-{i}"
                for b, batch in enumerate(leg["batches"])
                for i, r in enumerate(batch.get("requests", []))
            ]
            if scanned
            else []
        )
        last = next((n for n in reversed(last) if _request_of(leg, n)["key"] == key), None)
        for b, batch in enumerate(leg["batches"]):
            if batch["how"] in SLOT_STEPS:
                body += _slot_step(role, f"{role}-{b}", batch, leg["command"], requests_dir)
                continue
            if "server" in batch:  # a restore round's request: to the fresh llama-server after a restore-fresh
                body.append(f"use_server {batch['server']}")
            names = []
            for i, request in enumerate(batch["requests"]):
                name = f"{role}-{b}-{i}"
                (requests_dir / f"{name}.json").write_text(json.dumps(request["payload"]) + "\n")
                names.append(name)
                if request["key"] == key:
                    targets.setdefault(role, []).append(name)
            if batch["how"] == "par":  # at once; wait for these requests only (not for llama-server)
                body.append("REQS=(); " + " ".join(f"post {n} & REQS+=($!);" for n in names) + ' wait "${REQS[@]}"')
                body.append(f"judge_batch {role} {' '.join(names)}")
                body += _save_slot(last) if last in names else []
            else:  # one at a time: the failing request's slot is saved before the next request can take it
                for n in names:
                    body += [f"post {n}", f"judge_batch {role} {n}", *(_save_slot(n) if n == last else [])]
        body.append("stop_server")
        if scanned:
            body += _kv_verdict(case, last)
    lines += [
        f"SIGNATURE={shlex.quote(case['signature'])}",
        f"TARGETS={shlex.quote(' ' + ' '.join(targets.get(SUBJECT, [])) + ' ')}",
        *_subject_failed(case),
        *body,
        *_verdict(judge, targets, case),
        "}",
        *retry_loop(case.get("reproduction") or {}),
    ]
    path = bundle / "repro.sh"
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)
    return path


SAME = {
    "crash": "llama-server dies with the run's abort line (without one, the run's exit status), or, for a timeout, "
    "a request gets no answer in time while llama-server still runs",
    "error": "the failing request ends with an HTTP error of the run's message (numbers aside)",
    "differs": "the subject's output first differs from the reference's at the generated token where it did in the run",
    "rounds-differ": "the rounds' outputs differ",
    "kv": "the slot's KV scan finds the run's first kind of damage",
    "restore": "a turn served after its slot's save and restore drafts or accepts other counts than the same turn of "
    "the uninterrupted round, with the same tokens",
}
"""What counts as the run's signature, by judge."""


def _argv(command: list[str]) -> str:
    """The command line after the binary, with the PLACEHOLDERS expanded by the shell."""
    return " ".join(f'"{w}"' if w.startswith("$") else shlex.quote(w) for w in command[1:])


def _numbers_as_n(text: str) -> str:
    return re.sub(r"[0-9]+", "N", text)


def _subject_output_errors(case: dict) -> list[str]:
    subject = next(leg for leg in case["legs"] if leg["role"] == SUBJECT)
    return [o["error"] for o in subject["outputs"] if o.get("error")]


def expectation(case: dict) -> dict:
    """What the run's signature looks like to repro.sh: an abort line (numbers as N) or exit status of a crash,
    a timeout, an error message, the first divergent token of each round of the subject, a kind of KV damage."""
    signature, errors = case["signature"], _subject_output_errors(case)
    if case["judge"] == "crash":
        if signature.startswith("timeout:"):
            return {"timeout": True}
        reason = next((r for r in map(abort_reason, errors) if r), None)
        ended = next((m for m in (EXIT.search(e) for e in errors) if m), None)
        status = ""
        if ended and "killed by" in ended.group(0):
            name = ended.group(0).rsplit(" ", 1)[1]
            number = getattr(signal, name, None) if name.startswith("SIG") else int(name)
            status = str(128 + int(number)) if number is not None else ""
        elif ended:
            status = ended.group(0).rsplit(" ", 1)[1]
        return {"abort": _numbers_as_n(reason) if reason else "", "status": status}
    if case["judge"] == "error":
        first = next((e.splitlines()[0] for e in errors), "")
        message = re.sub(r"^.*?HTTP \d+: ", "", first)
        return {"message": _numbers_as_n(message)[:80]}
    if case["judge"] == "differs":
        reference = next((leg for leg in case["legs"] if leg["role"] == REFERENCE), None)
        subject = next(leg for leg in case["legs"] if leg["role"] == SUBJECT)
        expected = (reference or {}).get("outputs") or []
        if not expected or expected[0].get("error"):
            return {"at": []}
        want = expected[0]["tokens"]
        at = set()
        for o in subject["outputs"]:
            got = o.get("tokens") or []
            if not o.get("error") and got != want:
                at.add(
                    next(
                        (i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got))
                    )
                )
        return {"at": sorted(at)}
    if case["judge"] == "kv":
        damage = signature.split(": ", 1)[1] if signature.startswith("kv-healthy: ") else ""
        return {"damage": damage}
    return {}


def _subject_failed(case: dict) -> list[str]:
    """`subject_failed NAME...`: the verdict when a subject request failed (NAME: the batch's failed requests)."""
    judge, want = case["judge"], expectation(case)
    lines = [f"EXPECTED_STATUS={shlex.quote(want.get('status', ''))}", "subject_failed() {"]
    if judge == "crash" and want.get("timeout"):
        lines += [
            '  local n; for n in "$@"; do',
            '    if [ -z "$DIED" ] && timed_out "$n"; then reproduced "$n got no answer within $REQUEST_TIMEOUT s"; fi',
            "  done",
        ]
    elif judge == "crash":
        lines += [
            '  if [ -n "$DIED" ]; then',
            f'    if same_abort "$LOG_OF" {shlex.quote(want["abort"])}; then',
            '      reproduced "llama-server stopped answering (exit status $STATUS): $(abort_line "$LOG_OF")"',
            "    fi",
            "  fi",
        ]
    elif judge == "error":
        lines += [
            '  local n; for n in "$@"; do',
            '    case "$TARGETS" in *" $n "*) ;; *) continue ;; esac',
            '    if [ -z "$DIED" ] && [ "$(code_of "$n")" != 000 ] && '
            f'message_of "$n" | grep -qF -- {shlex.quote(want["message"])}; then',
            '      reproduced "$n: HTTP $(code_of "$n"): $(message_of "$n")"',
            "    fi",
            "  done",
        ]
    return [*lines, '  different "$(describe_failure "$@")"', "}"]


SLOT_STEPS = ("save", "restore", "close-fresh")
"""The steps of a restore round that are no /completion request (harness.repro.legs.batches)."""


def _slot_step(role: str, name: str, step: dict, command: list[str], requests_dir: Path) -> list[str]:
    """A restore round's slot step in repro.sh: save the slot, restore it (erase first; after the other
    conversation's request; into a fresh llama-server), or stop the fresh llama-server at the round's end."""
    how = step["how"]
    if how == "close-fresh":
        return ["use_server fresh", "stop_server", "use_server main"]
    slot, file = step["slot"], step["file"]
    if how == "save":
        return ["use_server main", f"slot_action {role} {slot} save {file}"]
    kind = step["kind"]
    if kind == "restore-fresh":
        lines = [f'echo "== {role}: a fresh llama-server for round {step["round"]}"', "use_server fresh"]
        lines += ['if [ -z "$PID" ]; then', f"  start_server {role}-fresh {_argv(command)}", "fi"]
        return [*lines, f"slot_action {role} {slot} restore {file}"]
    lines = ["use_server main"]
    if kind == "restore-over":  # another, longer conversation on the slot first
        (requests_dir / f"{name}-detour.json").write_text(json.dumps(step["detour"]) + "\n")
        lines += [f"post {name}-detour", f"judge_batch {role} {name}-detour"]
    else:
        lines.append(f"slot_action {role} {slot} erase")
    return [*lines, f"slot_action {role} {slot} restore {file}"]


def _request_of(leg: dict, name: str) -> dict:
    _, b, i = name.rsplit("-", 2)
    return leg["batches"][int(b)]["requests"][int(i)]


def _save_slot(name: str) -> list[str]:
    """Save the slot that served request `name` as slot.bin (right after it: before another request takes it)."""
    return [
        f'SLOT="$(grep -o \'"id_slot": *[0-9]*\' "$WORK/{name}.json" | head -n 1 | grep -o \'[0-9]*$\')"',
        "curl -s -X POST \"http://127.0.0.1:$PORT/slots/${SLOT:-0}?action=save\" -H 'Content-Type: application/json' "
        '-d \'{"filename": "slot.bin"}\' >/dev/null',
    ]


def _kv_verdict(case: dict, last: str) -> list[str]:
    """Scan the failing request's saved slot, and judge its first kind of damage."""
    damages = [name for _, name in KV_DAMAGE]
    want = expectation(case)["damage"]
    return [
        'if ! command -v "$SPECHARNESS" >/dev/null; then',
        "  echo 'the KV verdict needs specharness scan: set SPECHARNESS to it, or get specharness as ISSUE.md says'",
        "  exit 2",
        "fi",
        '"$SPECHARNESS" scan "$WORK/slot.bin" --model "$MODEL" --json >"$WORK/scan.json" 2>"$WORK/scan.err"; status=$?',
        "# the scan exits 0 healthy, 1 unhealthy, and says which in its JSON: a scanner that failed (a Python error",
        "# exits 1 too) has no such JSON and judges nothing",
        'case $status in 0) HEALTHY=true ;; 1) HEALTHY=false ;; *) HEALTHY="" ;; esac',
        'if [ -z "$HEALTHY" ] || ! grep -Eq "\\"healthy\\": *$HEALTHY" "$WORK/scan.json"; then',
        '  echo "specharness scan could not read the slot file (exit $status): $(tail -n 1 "$WORK/scan.err")"; exit 2',
        "fi",
        'count_of() { grep -o "\\"$1\\": [0-9]*" "$WORK/scan.json" | head -n 1 | grep -o \'[0-9]*$\'; }',
        'POS_MAX="$(grep -o \'"pos_max": [0-9]*\' "$WORK/scan.json" | grep -o \'[0-9]*$\' | sort -n | tail -n 1)"',
        f"PROMPT_N=\"$(grep -o '\"prompt\": *\\[[^]]*\\]' \"$HERE/requests/{last}.json\" | tr ',' '\\n' | wc -l)\"",
        f'RETURNED_N="$(tokens_of {last} | wc -w)"',
        f'if grep -Eq \'"stop_type": *"eos"\' "$WORK/{last}.json"; then',
        "  RETURNED_N=$((RETURNED_N - 1))  # llama-server lists the end-of-generation token it stopped on: not returned",
        "fi",
        "FOUND=''",
        f'if [ "$(count_of duplicate_cells)" -gt 0 ] 2>/dev/null; then FOUND={shlex.quote(damages[0])}',
        f'elif [ "$(count_of orphans)" -gt 0 ] 2>/dev/null; then FOUND={shlex.quote(damages[1])}',
        f'elif [ "$(count_of missing_positions)" -gt 0 ] 2>/dev/null; then FOUND={shlex.quote(damages[2])}',
        f'elif ! grep -Eq \'"truncated": *true\' "$WORK/{last}.json" && '
        f'[ "${{POS_MAX:--1}}" -ge $((PROMPT_N + RETURNED_N)) ]; then FOUND={shlex.quote(damages[3])}',
        "fi",
        'echo "KV scan of the slot: ${FOUND:-healthy} (positions up to ${POS_MAX:-?} after $PROMPT_N prompt + '
        '$RETURNED_N returned tokens)"',
        f'if [ -n "$FOUND" ] && [ "$FOUND" = {shlex.quote(want)} ]; then reproduced "kv-healthy: $FOUND"; fi',
        'if [ -n "$FOUND" ]; then different "kv-healthy: $FOUND"; fi',
        'echo "not reproduced: the KV cache of the slot is healthy"',
        "exit 0",
    ]


def _verdict(judge: str, targets: dict[str, list[str]], case: dict) -> list[str]:
    subject = targets.get(SUBJECT, [])
    if judge in ("crash", "error"):
        return ['echo "not reproduced: every request completed"', "exit 0"]
    if judge == "differs":
        expected = targets[REFERENCE][0]
        at = " ".join(map(str, expectation(case)["at"]))
        out = [
            f'EXPECTED="$(tokens_of {expected})"',
            'echo "expected ({}): $EXPECTED"'.format(case["reference_what"]),
            f"RUN_AT=' {at} '  # where each round's output first diverged in the run",
            "REPRODUCED=0; MOVED=''",
        ]
        for n in subject:
            out += [
                f'ACTUAL="$(tokens_of {n})"',
                'echo "actual   (subject):   $ACTUAL"',
                'if [ "$ACTUAL" != "$EXPECTED" ]; then',
                '  AT="$(first_difference "$EXPECTED" "$ACTUAL")"',
                '  echo "first divergence at generated token $AT"',
                '  case "$RUN_AT" in "  "|*" $AT "*) REPRODUCED=1 ;; *) MOVED="$MOVED $AT" ;; esac',
                "fi",
            ]
        return [
            *out,
            'if [ $REPRODUCED = 1 ]; then reproduced "the output first diverges where it did in the run"; fi',
            'if [ -n "$MOVED" ]; then different "the output first diverges at token(s)$MOVED, in the run at$RUN_AT"; fi',
            'echo "not reproduced: the outputs are equal"',
            "exit 0",
        ]
    if judge == "restore":
        return _restore_verdict(case)
    if judge == "rounds-differ":
        out = [f'FIRST="$(tokens_of {subject[0]})"', 'echo "round 1: $FIRST"', "REPRODUCED=0"]
        for i, n in enumerate(subject[1:], start=2):
            out += [
                f'OTHER="$(tokens_of {n})"',
                f'echo "round {i}: $OTHER"',
                'if [ "$OTHER" != "$FIRST" ]; then REPRODUCED=1; fi',
            ]
        return [
            *out,
            'if [ $REPRODUCED = 1 ]; then reproduced "the rounds differ"; fi',
            'echo "not reproduced: every round gave the same tokens"',
            "exit 0",
        ]
    return []


def _restore_verdict(case: dict) -> list[str]:
    """The failing turn's drafted and accepted counts after each restore against the uninterrupted round's: other
    counts with the same tokens reproduce it; other tokens are a different failure (the target's state)."""
    subject = next(leg for leg in case["legs"] if leg["role"] == SUBJECT)
    served = [
        (f"{SUBJECT}-{b}-{i}", r)
        for b, batch in enumerate(subject["batches"])
        for i, r in enumerate(batch.get("requests", []))
        if r["key"] == case["key"]
    ]
    reference = next((n for n, r in served if r["kind"] not in RESTORE_ROUNDS), None)
    restored = [(n, r) for n, r in served if r["kind"] in RESTORE_ROUNDS]
    if reference is None or not restored:
        return ['echo "the bundle has no uninterrupted and restored turn to compare"', "exit 2"]
    out = [
        f'EXPECTED="$(counts_of {reference})"; EXPECTED_TOKENS="$(tokens_of {reference})"',
        'echo "uninterrupted: drafted / accepted $EXPECTED"',
        "REPRODUCED=0; OTHER=''",
    ]
    for name, r in restored:
        out += [
            f'ACTUAL="$(counts_of {name})"',
            f'echo "round {r["round"]} ({r["kind"]}): drafted / accepted $ACTUAL"',
            f'if [ "$(tokens_of {name})" != "$EXPECTED_TOKENS" ]; then OTHER="$OTHER {r["round"]}"',
            'elif [ "$ACTUAL" != "$EXPECTED" ]; then REPRODUCED=1; fi',
        ]
    return [
        *out,
        'if [ -n "$OTHER" ]; then different "the restored turn returned other tokens than the uninterrupted one '
        '(round(s)$OTHER)"; fi',
        'if [ $REPRODUCED = 1 ]; then reproduced "a restored turn drafted / accepted other counts, same output"; fi',
        'echo "not reproduced: every restored turn drafted and accepted as the uninterrupted one"',
        "exit 0",
    ]
