#!/usr/bin/env bash
# specharness CI for a llama.cpp fork: the shell steps of docs/ci.md's GitHub Actions workflow.
#
#   fork-ci.sh build SRC_DIR OUT_BIN           build llama-server from a llama.cpp checkout, copy it to OUT_BIN
#   fork-ci.sh shard BASE_BIN HEAD_BIN I N DIR run shard I/N of the suites against both binaries:
#                                              DIR/base-I and DIR/head-I (one machine: comparable timings)
#   fork-ci.sh report N DIR                    merge DIR/base-* into DIR/base and DIR/head-* into DIR/head,
#                                              diff base vs head into DIR/head/diff.html; exit 1 on a regression
#   fork-ci.sh all BASE_BIN HEAD_BIN N DIR     every shard one after another, then report (a local run)
#
# SPECHARNESS_CI_ARGS: the `specharness run` selection (default: the quicksort suite on llama-server).
# Exit status: 0 no regression, 1 a regression (report) or a failed step, 2 bad usage.
set -euo pipefail

SELECTION=${SPECHARNESS_CI_ARGS:-"--suite quicksort --backend server"}

usage() {
  sed -n '4,11p' "$0" >&2
  exit 2
}

# One side of a shard. `specharness run` exits 1 when a check failed: that is the diff's to judge, not this
# step's; any other failure (bad input 2, a server that could not be started 3, interrupted 130) ends the job.
run_side() {
  local bin=$1 part=$2 out=$3 status=0
  # shellcheck disable=SC2086  # SELECTION is a list of options
  specharness run $SELECTION --server-bin "$bin" --shard "$part" --out "$out" || status=$?
  if [ "$status" -ne 0 ] && [ "$status" -ne 1 ]; then
    echo "fork-ci: specharness run --shard $part against $bin exited $status" >&2
    exit "$status"
  fi
}

cmd=${1:-}
[ -n "$cmd" ] || usage
shift
case "$cmd" in
  build)
    [ $# -eq 2 ] || usage
    bin=$(specharness build --source "$1")  # the binary's path alone
    mkdir -p "$(dirname "$2")"
    cp "$bin" "$2"
    echo "fork-ci: llama-server of $1 -> $2"
    ;;
  shard)
    [ $# -eq 5 ] || usage
    run_side "$1" "$3/$4" "$5/base-$3"
    run_side "$2" "$3/$4" "$5/head-$3"
    ;;
  report)
    [ $# -eq 2 ] || usage
    n=$1 dir=$2
    for side in base head; do
      parts=()
      for i in $(seq 1 "$n"); do parts+=("$dir/$side-$i"); done
      specharness report --merge "${parts[@]}" --out "$dir/$side"
    done
    specharness diff "$dir/base" "$dir/head" --out "$dir/head/diff.html"
    ;;
  all)
    [ $# -eq 4 ] || usage
    for i in $(seq 1 "$3"); do "$0" shard "$1" "$2" "$i" "$3" "$4"; done
    "$0" report "$3" "$4"
    ;;
  *)
    usage
    ;;
esac
