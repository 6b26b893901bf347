#!/usr/bin/env bash
# The Kimi K2.6 report from one H200 (141 GB: a full 61-layer TP8 rank is about 70 GB of weights
# beside its KV pool): every run `benchmarks/moe.py --sections kimi` reads, then that section.
#
#   benchmarks/kimi_rank.sh OUT_DIR [STAGE...]
#
# Stages, all in this order by default:
#   tp8         the TP8 rank: decode at batches 1-128, verifies of 8-64 nodes, the draft step,
#               each against its floor; none, DFlash and DDTree at concurrency 1 under the
#               acceptance oracle (chain acceptance 5.0 at block 8); a profile of the steps
#   sweep       the TP8 rank end to end at concurrency 1 and 32 (into tp8.{md,json})
#   ep8         the EP8 rank's steps and verifies
#   moe         the rank's MoE layer alone, graph-replayed (the fixed cost, INT4 bandwidth)
#   mla         MLA's latent attention at a rank's 8 heads
#   moe-target  the Qwen3-30B-A3B shape's steps (AR and chain verify against their floors)
#   report      OUT_DIR/kimi-rank.{md,json}: the goals, the prediction for 8 GPUs, the tables
# Each stage writes OUT_DIR/<stage>.{md,json}, so that stages can run in separate calls on one
# machine (a device call's time limit) and `report` reads what they left. LAYERS (default 61)
# and BUILT_LAYERS (default: every layer built) set the ranks' depth: on an 80 GB GPU,
# BUILT_LAYERS=31 builds 31 layers and repeats the 30 MoE layers' weights up to 61.
set -euo pipefail
if [[ $# -lt 1 ]]; then
    echo "usage: $0 OUT_DIR [tp8 sweep ep8 moe mla moe-target report]" >&2
    exit 2
fi
out=$1
shift
stages=("$@")
[[ ${#stages[@]} -gt 0 ]] || stages=(tp8 sweep ep8 moe mla moe-target report)
mkdir -p "$out"
depth=(--layers "${LAYERS:-61}")
[[ -z ${BUILT_LAYERS:-} ]] || depth+=(--built-layers "$BUILT_LAYERS")
rank=(python -m benchmarks.speculative --shape kimi-k2.6 --reps 5 --copy-mib 1024
      --verify-ctxs 1024 --trees 8,16,32,64 "${depth[@]}" --dflash-tau 5.0 --ddtree-tau 7.0)

for stage in "${stages[@]}"; do
    case $stage in
    tp8)
        "${rank[@]}" --layout tp8 --sections steps,verify,calibrate,c1,profile \
            --batches 1,8,32,128 --prompts 4 --tokens 64 --skip 16 --budgets 7,15,31,63 \
            --curve-taus= --profile-steps 4 --out "$out/tp8.md";;
    sweep)
        "${rank[@]}" --layout tp8 --sections sweep --levels 1,32 --rounds 1 \
            --sweep-tokens 48 --skip 16 --out "$out/tp8.md";;
    ep8)
        "${rank[@]}" --layout ep8 --sections steps,verify --batches 1,8,32,128 \
            --out "$out/ep8.md";;
    moe)
        python -m benchmarks.moe --shapes kimi-k2.6 --layout tp8 --reps 10 --out "$out/moe.md";;
    mla)
        python -m benchmarks.kernels --sections mla --mla-heads 8 --mla-contexts 1024,16384 \
            --mla-batches 1,32 --out "$out/mla.md";;
    moe-target)
        python -m benchmarks.speculative --shape qwen3-30b-a3b --sections steps \
            --batches 1,8,32,128 --out "$out/moe-target.md";;
    report)
        ranks=()
        for f in tp8 ep8; do [[ ! -f $out/$f.json ]] || ranks+=("$out/$f.json"); done
        [[ ${#ranks[@]} -gt 0 ]] || { echo "report: no tp8.json or ep8.json in $out" >&2
                                      exit 2; }
        extra=()
        for f in moe mla moe-target; do
            [[ ! -f $out/$f.json ]] || extra+=("--$f" "$out/$f.json")
        done
        python -m benchmarks.moe --sections kimi --ranks "$(IFS=,; echo "${ranks[*]}")" "${extra[@]}" \
            --out "$out/kimi-rank.md";;
    *)
        echo "unknown stage '$stage': tp8, sweep, ep8, moe, mla, moe-target or report" >&2
        exit 2;;
    esac
done
