#!/usr/bin/env bash
# Adaptive vs fixed DDTree vs plain decoding over concurrency 1..256, several runs with the spec
# order rotated between runs (the first engine of a process can run slower than the next ones).
#
#   benchmarks/concurrency_sweep.sh MODEL DRAFT OUT_DIR [RUNS]
#
# Each run writes OUT_DIR/runK/{low,high}_concurrency/ (`flashtree bench` reports and plots);
# OUT_DIR/summary.{md,png} then sums up every run there (`python -m benchmarks.serving summary`).
# Sizes can be changed through the environment: LOW_SPECS, LOW_CONC, LOW_PROMPTS, LOW_TOKENS,
# HIGH_SPECS, HIGH_CONC, HIGH_PROMPTS, HIGH_TOKENS (specs comma-separated, as `--spec` takes them) (a prompt count per concurrency, or one for all: by default 24, 48
# and 96 at 1, 4 and 16, so that a run at 16 lasts more than the H200 host's slow stretches,
# where 24 prompts took 0.4 s); ROUNDS=R times each method R times per run, interleaved in one
# process (`flashtree bench --rounds`); FIRST_RUN=K starts at run K (seed K, order rotated
# K - 1 times), so that runs can be split between processes, e.g. one per GPU; HALF=low or
# HALF=high runs that half alone.
set -euo pipefail
if [[ $# -lt 3 || ! ${4:-3} =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 MODEL DRAFT OUT_DIR [RUNS, a positive integer; default 3]" >&2
    exit 2
fi
model=$1 draft=$2 out=$3 runs=${4:-3}
IFS=, read -ra low_specs <<<"${LOW_SPECS:-none,ddtree,ddtree:fixed:7,ddtree:fixed}"
IFS=, read -ra high_specs <<<"${HIGH_SPECS:-none,ddtree,ddtree:fixed}"

rotated() {  # rotated K SPEC... -> the specs joined by commas, starting at index K mod count
    local k=$1; shift
    local specs=("$@") n=$#
    local order=()
    for ((i = 0; i < n; i++)); do order+=("${specs[$(((k + i) % n))]}"); done
    (IFS=,; echo "${order[*]}")
}

first=${FIRST_RUN:-1}
half=${HALF:-both}
if [[ ! $half =~ ^(low|high|both)$ ]]; then
    echo "HALF must be low, high or both, not '$half'" >&2
    exit 2
fi
for ((run = first; run < first + runs; run++)); do
    [[ $half == high ]] || flashtree bench --model "$model" --draft "$draft" --no-progress --dataset chat --seed "$run" \
        --spec "$(rotated $((run - 1)) "${low_specs[@]}")" --concurrency "${LOW_CONC:-1,4,16}" \
        --num-prompts "${LOW_PROMPTS:-24,48,96}" --max-tokens "${LOW_TOKENS:-128}" \
        --rounds "${ROUNDS:-1}" \
        --output-dir "$out/run$run/low_concurrency"
    [[ $half == low ]] || flashtree bench --model "$model" --draft "$draft" --no-progress --dataset chat --seed "$run" \
        --spec "$(rotated $((run - 1)) "${high_specs[@]}")" --concurrency "${HIGH_CONC:-64,256}" \
        --num-prompts "${HIGH_PROMPTS:-768}" --max-tokens "${HIGH_TOKENS:-96}" \
        --rounds "${ROUNDS:-1}" \
        --output-dir "$out/run$run/high_concurrency"
done
PYTHONPATH="$(dirname "$0")/..${PYTHONPATH:+:$PYTHONPATH}" python3 -m benchmarks.serving summary "$out"
