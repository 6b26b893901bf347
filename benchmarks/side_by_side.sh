#!/usr/bin/env bash
# A change against the commit before it, on one GPU in one call: the speculative steps of commit
# REF and of the working tree, one after the other on the same warm machine, then the working
# tree's steps against REF's (`speculative.py --guard`: exits 1 when a step is slower than
# REF's by more than --guard-tolerance, 3% by default).
#
#   benchmarks/side_by_side.sh prepare REF     # where the git history is: REF into $BEFORE
#   benchmarks/side_by_side.sh run [ARGS...]   # on the GPU, $BEFORE beside the working tree
#   benchmarks/side_by_side.sh profile [ARGS...]
#
# `profile` is for changes to the host's work in a step, which the steps' times replayed alone
# do not see: the engine steps under the profiler (`--sections profile`: wall and GPU-busy
# time per step, and the speculative steps' host time from each device read to the next
# launch), REF's and the working tree's alternately, ROUNDS times (default 3: the
# host's noise moves a step's wall time by more than such a change).
#
# BEFORE (default .before, git-ignore it) holds REF's flashtree/ and benchmarks/ (no drafter
# weights: the steps build random ones). ARGS go to both runs after `--sections steps`, e.g.
# `--batches 1,8 --sections steps,verify --trees 16,64,256`. OUT (default /tmp/side_by_side)
# receives before.{md,json} and after.{md,json}.
set -euo pipefail
before=${BEFORE:-.before}
case "${1:-}" in
prepare)
    [[ $# -eq 2 ]] || { echo "usage: $0 prepare REF" >&2; exit 2; }
    rm -rf "$before" && mkdir -p "$before"
    git archive "$2" flashtree benchmarks ':(exclude)flashtree/drafters' | tar -x -C "$before"
    echo "$2 is in $before";;
run|profile)
    kind=$1
    shift
    [[ -d $before/flashtree ]] || { echo "no $before/flashtree: run '$0 prepare REF' first" >&2
                                    exit 2; }
    mkdir -p "${OUT:=/tmp/side_by_side}"
    out=$(cd "$OUT" && pwd)
    if [[ $kind == run ]]; then
        (cd "$before" && python -m benchmarks.speculative --sections steps "$@" \
            --out "$out/before.md")
        python -m benchmarks.speculative --sections steps "$@" --out "$out/after.md" \
            --guard "$out/before.json"
        exit
    fi
    for round in $(seq "${ROUNDS:-3}"); do
        for side in before after; do
            report=$out/profile-$side-$round.md
            if [[ $side == before ]]; then dir=$before; else dir=.; fi
            (cd "$dir" && python -m benchmarks.speculative --sections profile "$@" \
                --out "$report" >/dev/null)
            grep -E '^\*\*(none|dflash|ddtree)\*\*|^From each device read' "$report" \
                | sed -E "s/^/$side $round /; s/, [0-9.]+ (device reads|launches).*//;
                          s/ of host work, timed bare.*/ of host work/"
        done
    done;;
*)
    echo "usage: $0 prepare REF | run [speculative.py ARGS...] | profile [ARGS...]" >&2
    exit 2;;
esac
