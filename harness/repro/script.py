"""`repro.sh`: the failing case against llama-server with nothing but bash and curl.

It starts each leg's exact llama-server command line on a free loopback port, sends the exact /completion
bodies (prompts as token ids, from `requests/`) the way they were sent (one at a time, or a batch at once),
prints expected against actual and exits 1 when the failure reproduces, 0 when it does not, 2 when it could
not tell (the server did not start, the reference failed). `$LLAMA_SERVER`, `$MODEL` and `$DRAFT_MODEL`
replace the run's binary and models; `$REQUEST_TIMEOUT` (seconds, default 120) bounds each request.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from harness.repro.legs import JUDGES, REFERENCE, SUBJECT

HELPERS = r"""
WORK="$(mktemp -d)"
PID=""
cleanup() {
  if [ -n "$PID" ]; then kill "$PID" 2>/dev/null; wait "$PID" 2>/dev/null; fi
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

start_server() {  # LEG ARGS...: start llama-server and wait until /health answers
  local leg="$1"; shift
  local try
  for try in 1 2 3 4 5; do  # another process may take the free port before llama-server binds it
    PORT="$(free_port)"
    echo "\$ $LLAMA_SERVER --host 127.0.0.1 --port $PORT $*"
    "$LLAMA_SERVER" --host 127.0.0.1 --port "$PORT" "$@" >"$WORK/$leg.log" 2>&1 &
    PID=$!
    for _ in $(seq 1 600); do
      if ! kill -0 "$PID" 2>/dev/null; then
        wait "$PID" 2>/dev/null; PID=""
        if grep -q "couldn't bind HTTP server socket" "$WORK/$leg.log"; then continue 2; fi
        echo "llama-server exited during start-up:"; tail -n 5 "$WORK/$leg.log"; exit 2
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

post() {  # NAME: send requests/NAME.json to /completion; the answer goes to $WORK/NAME.json, its HTTP status to NAME.code
  curl -s -o "$WORK/$1.json" -w '%{http_code}' --max-time "$REQUEST_TIMEOUT" -H 'Content-Type: application/json' \
    --data-binary "@$HERE/requests/$1.json" "http://127.0.0.1:$PORT/completion" >"$WORK/$1.code" 2>/dev/null || true
}

code_of() { cat "$WORK/$1.code" 2>/dev/null || echo 000; }

tokens_of() {  # NAME: the generated token ids of an answer, space-separated
  grep -o '"tokens":\[[^]]*\]' "$WORK/$1.json" 2>/dev/null | head -n 1 | sed -e 's/"tokens":\[//' -e 's/\]//' -e 's/,/ /g'
}

crashed() {  # LEG NAME...: 0 when the server died or one of the requests got no answer / a 5xx
  local leg="$1"; shift
  local name code
  for name in "$@"; do
    code="$(code_of "$name")"
    if [ "$code" = 000 ] || [ "$code" -ge 500 ]; then return 0; fi
  done
  ! kill -0 "$PID" 2>/dev/null
}

abort_line() {  # LEG: the line of the server log that says why it stopped
  grep -m 1 -E 'GGML_ASSERT|GGML_ABORT|what\(\)|Segmentation|terminate called|error' "$WORK/$1.log" || tail -n 1 "$WORK/$1.log"
}

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
        "# Exit status: 1 the failure reproduces, 0 it does not, 2 it could not be told.",
        "set -u",
        'HERE="$(cd "$(dirname "$0")" && pwd)"',
    ]
    for name, value in defaults.items():
        lines.append(f'{name}="${{{name}:-{value}}}"')
    lines += ['REQUEST_TIMEOUT="${REQUEST_TIMEOUT:-120}"', 'SPECHARNESS="${SPECHARNESS:-specharness}"', HELPERS]
    targets: dict[str, list[str]] = {}
    for leg in case["legs"]:
        role = leg["role"]
        lines += [f'echo "== {role}: {leg["cell_id"]}"', "start_server " + role + " " + _argv(leg["command"])]
        names_of_leg = []
        for b, batch in enumerate(leg["batches"]):
            names = []
            for i, request in enumerate(batch["requests"]):
                name = f"{role}-{b}-{i}"
                (requests_dir / f"{name}.json").write_text(json.dumps(request["payload"]) + "\n")
                names.append(name)
                if request["key"] == key:
                    targets.setdefault(role, []).append(name)
            names_of_leg += names
            if batch["how"] == "par":
                lines.append(" ".join(f"post {n} &" for n in names) + " wait")
            else:
                lines += [f"post {n}" for n in names]
            lines += [f"if crashed {role} {' '.join(names)}; then", *_on_crash(role, judge), "fi"]
        if role == SUBJECT and judge == "kv":
            last = targets[SUBJECT][-1]
            lines += [
                f'SLOT="$(grep -o \'"id_slot":[0-9]*\' "$WORK/{last}.json" | head -n 1 | cut -d: -f2)"',
                "curl -s -X POST \"http://127.0.0.1:$PORT/slots/${SLOT:-0}?action=save\" -H 'Content-Type: application/json' "
                '-d \'{"filename": "slot.bin"}\' >/dev/null',
                "stop_server",
                'if ! command -v "$SPECHARNESS" >/dev/null; then echo "the KV verdict needs `specharness scan` (pip install specharness) or $SPECHARNESS"; exit 2; fi',
                '"$SPECHARNESS" scan "$WORK/slot.bin" --model "$MODEL"; status=$?',
                'if [ $status = 1 ]; then echo "REPRODUCED: the KV cache of the slot is unhealthy"; exit 1; fi',
                'if [ $status = 0 ]; then echo "not reproduced: the KV cache of the slot is healthy"; exit 0; fi',
                "exit 2",
            ]
        else:
            lines.append("stop_server")
    lines += _verdict(judge, targets, case)
    path = bundle / "repro.sh"
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)
    return path


def _argv(command: list[str]) -> str:
    """The command line after the binary, with the PLACEHOLDERS expanded by the shell."""
    return " ".join(f'"{w}"' if w.startswith("$") else shlex.quote(w) for w in command[1:])


def _on_crash(role: str, judge: str) -> list[str]:
    if role == SUBJECT and judge == "crash":
        return [f'  echo "REPRODUCED: llama-server stopped answering: $(abort_line {role})"', "  exit 1"]
    return [
        f'  echo "the {role} leg did not complete: $(abort_line {role})"',
        f"  exit {1 if role == SUBJECT and judge == 'error' else 2}",
    ]


def _verdict(judge: str, targets: dict[str, list[str]], case: dict) -> list[str]:
    subject = targets.get(SUBJECT, [])
    if judge in ("crash", "error"):
        check = (
            [
                f'if [ "$(code_of {n})" != 200 ]; then echo "REPRODUCED: $(cat "$WORK/{n}.json")"; exit 1; fi'
                for n in subject
            ]
            if judge == "error"
            else []
        )
        return [*check, 'echo "not reproduced: every request completed"', "exit 0"]
    if judge == "differs":
        expected = targets[REFERENCE][0]
        out = [
            f'EXPECTED="$(tokens_of {expected})"',
            'echo "expected ({}): $EXPECTED"'.format(case["reference_what"]),
            "REPRODUCED=0",
        ]
        for n in subject:
            out += [
                f'ACTUAL="$(tokens_of {n})"',
                'echo "actual   (subject):   $ACTUAL"',
                'if [ "$ACTUAL" != "$EXPECTED" ]; then',
                '  echo "first divergence at generated token $(first_difference "$EXPECTED" "$ACTUAL")"',
                "  REPRODUCED=1",
                "fi",
            ]
        return [
            *out,
            'if [ $REPRODUCED = 1 ]; then echo "REPRODUCED"; exit 1; fi',
            'echo "not reproduced: the outputs are equal"',
            "exit 0",
        ]
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
            'if [ $REPRODUCED = 1 ]; then echo "REPRODUCED: the rounds differ"; exit 1; fi',
            'echo "not reproduced: every round gave the same tokens"',
            "exit 0",
        ]
    return []
