#!/usr/bin/env bash
# Issue 16, eleventh session (branch quant11), one H200, one call: BUDGET seconds of command (the machine's
# start comes on top: ask `run` for BUDGET + ~15 s). tools/device/quant9_call.sh does the work, on this
# session's plan (tools/device/quant11_plan.json): 1-layer init-model alone first; then side by side the
# 24 x 32 init-model, the quantized GEMVs' GPU tests and three 1-layer warm-ups compiling the plan's
# kernel variants; then quant9_sweep.py on 24 x 32: per (experts, attention) one load, per setting the
# decode graphs recaptured, tok/s at batch 1 (and 8 where the plan says) all resident, and each kernel's
# us a call in the graph (CUPTI, 4 replayed steps). The settings: bf16; int4 + fp8 attention and fp8 +
# fp8 attention without ROUND_GATE (the default: the ninth session's kernels) against with it
# and a few work shapes; fp8 experts with bf16 attention. Figures: stdout's table; $OUT/sweep.txt
# (one JSON line a figure, every kernel); $OUT/gpu_tests.txt.
BUDGET=${BUDGET:-195}
start=$(date +%s)
export WARM_S=${WARM_S:-50} TESTS_S=${TESTS_S:-50} INIT_S=${INIT_S:-50} STEPS=${STEPS:-4} TOP=${TOP:-4}
export PLAN=${PLAN:-quant11_plan.json}  # quant11_plan_short.json: bf16; int4 and fp8 with the gate on and off
# what is left for the sweep: setup (~10 s), the 1-layer init-model (~10 s), the side-by-side phase
# (WARM_S), the cache merge and the table (~10 s)
export SWEEP_S=${SWEEP_S:-$((BUDGET - WARM_S - 32))}
echo "quant11: BUDGET $BUDGET, warm-ups ${WARM_S} s, sweep ${SWEEP_S} s"
bash tools/device/quant9_call.sh
echo "quant11: $(( $(date +%s) - start )) s"
