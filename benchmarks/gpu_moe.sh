#!/usr/bin/env bash
# GPU measurements of issue 49 (Qwen3.5-35B-A3B, MoE), each step under its own timeout, results under OUT as written.
#   bash benchmarks/gpu_moe.sh kernel OUT   one layer's experts: each implementation and kernel tiles, decode and prefill
#   bash benchmarks/gpu_moe.sh model OUT    benchmarks/results/moe_qwen35_35b_a3b.json (the 40-layer shape end to end)
#   bash benchmarks/gpu_moe.sh both OUT     the two in one command (short: a shorter version)
#   bash benchmarks/gpu_moe.sh sweep OUT    the kernel's tiles swept, then the model's first stages with the fastest
#   bash benchmarks/gpu_moe.sh sweep_b OUT  (same OUT, next command) the model's other stages at those tiles
#   bash benchmarks/gpu_moe.sh model_a OUT, then model_b OUT: the model at the library's defaults in two commands
#   then: python benchmarks/bench_moe.py --merge OUT/moe_qwen35_35b_a3b_a.json OUT/moe_qwen35_35b_a3b_b.json --out benchmarks/results
#   bash benchmarks/gpu_moe.sh model1 OUT   the headline file in one command (440 s on an H100 at 8d87364; XLA's
#                                           paths left out: they run out of memory at this shape)
#   bash benchmarks/gpu_moe.sh model1a OUT, then model1b OUT: the same in two commands (each under 500 s), then
#                                           bench_moe.py --merge OUT/*_a.json OUT/*_b.json --out benchmarks/results
#   bash benchmarks/gpu_moe.sh layout OUT   the experts' layout sorted against compared, 10 layers (its A/B, ~2 min)
#   bash benchmarks/gpu_moe.sh variants OUT AR under each of bench_moe.VARIANTS (today: the shared expert as XLA
#                                           GEMMs or as a tile of the expert kernel), alternating over ROUNDS (2)
#                                           rounds, 10 layers (~4 min); the fastest's settings
#                                           in OUT/fastest_settings.txt; then `MOE_SETTINGS=... gpu_moe.sh model1 OUT`
set -u
# block_m,block_n,block_k,num_warps,num_stages: decode tiles (block_m 16) and prefill tiles (block_m 64), block_k 64
# and 128 in both (a decode pick's prefill partner shares its block_k). The narrow decode tiles (block_n 16 and 32 at
# block_k 128) put more programs on a step's few experts (docs/LOG.md, 2026-12-07: 64 working programs at block_n 64).
SWEEP_BLOCKS=${SWEEP_BLOCKS:-"16,16,128,4,3;16,32,128,4,3;16,64,64,4,4;16,128,64,4,4;16,64,128,4,3;64,64,64,4,3;64,128,64,4,3;64,64,128,4,3"}
part=${1:?part kernel or model}
out=${2:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
. "$(dirname "$0")/gpu_step.sh"
case $part in
kernel)
    step 150 kernel python benchmarks/bench_moe.py --part kernel ;;
model)
    step 560 model python benchmarks/bench_moe.py --part model --experts pallas --time-budget-s 540 --out "$out" ;;
both)  # one device command: the model (the issue's result), then the kernels alone with what is left
    step 450 model python benchmarks/bench_moe.py --part model --experts pallas --time-budget-s 430 --out "$out"
    step 120 kernel python benchmarks/bench_moe.py --part kernel ;;
short)  # a short lease: the kernels (90 s), then the model for 240 s (AR, the gamma 4 and 8 rows as time allows)
    step 90 kernel python benchmarks/bench_moe.py --part kernel --blocks "16,32,64,4,4;16,64,64,4,4;64,64,64,4,3"
    step 250 model python benchmarks/bench_moe.py --part model --experts pallas --time-budget-s 240 --repeats 1 --out "$out" ;;
model_a)  # the model in two device commands (each stage compiles for ~40-95 s at this shape): AR, its exactness, XLA's
    # paths as the baseline, one row ...
    step 570 model_a python benchmarks/bench_moe.py --part model --time-budget-s 550 --stages ngram,onerow,xla \
        --suffix _a --out "$out" ;;
model_b)  # ... then the curve, the 8K prompt and MTP
    step 570 model_b python benchmarks/bench_moe.py --part model --time-budget-s 550 --stages curve,long,mtp \
        --suffix _b --out "$out" ;;
model1)  # the headline file: AR (default, one row), a device trace of AR, the curve, the 8K prompt, MTP as time allows
    step 500 model python benchmarks/bench_moe.py --part model --stages onerow,profile,curve,long,mtp \
        --time-budget-s 470 --out "$out" ${MOE_SETTINGS:+--settings "$MOE_SETTINGS"} ;;
model1a)  # the headline file in two commands: AR (default, one row), a device trace, the curve ...
    step 500 model1a python benchmarks/bench_moe.py --part model --stages onerow,profile,curve --time-budget-s 470 \
        --suffix _a --out "$out" ${MOE_SETTINGS:+--settings "$MOE_SETTINGS"} ;;
model1b)  # ... then the 8K prompt and MTP (bench_moe.py --merge joins the two)
    step 500 model1b python benchmarks/bench_moe.py --part model --stages long,mtp --time-budget-s 470 \
        --suffix _b --out "$out" ${MOE_SETTINGS:+--settings "$MOE_SETTINGS"} ;;
variants)  # bench_moe.VARIANTS alternating in one process, at 10 layers
    step 440 variants python benchmarks/bench_moe.py --part model --layers 10 --stages variants --repeats 2 \
        --rounds "${ROUNDS:-2}" --time-budget-s 420 --out "$out"
    python -c "import json, sys; from benchmarks.bench_moe import SETTINGS; d = json.load(open(sys.argv[1]))
v = d['variants'][d['fastest_variant']]; print(','.join(f'{k}={v[k]}' for k in SETTINGS))" \
        "$out/moe_qwen35_35b_a3b_10layers.json" | tee "$out/fastest_settings.txt" ;;
layout)  # experts.LAYOUT_COMPARE_MAX_COPIES 0 against 256, alternating in one process, at 10 layers
    step 200 layout python benchmarks/bench_moe.py --part model --layers 10 --stages layout --repeats 3 \
        --time-budget-s 180 --out "$out" ;;
sweep)  # the kernel's tiles swept (KERNEL_S, 90 s), then the model's first stages at the fastest
    # (`bench_moe.chosen_blocks`) for MODEL_S (470 s); `sweep_b` the rest at the same tiles, in a second command
    step "${KERNEL_S:-90}" kernel python benchmarks/bench_moe.py --part kernel --out "$out" --blocks "$SWEEP_BLOCKS"
    step "${MODEL_S:-470}" model_a python benchmarks/bench_moe.py --part model --experts pallas \
        --time-budget-s "$(( ${MODEL_S:-470} - 20 ))" --out "$out" --stages ngram,onerow,xla --suffix _a \
        --blocks-from "$out/moe_qwen35_35b_a3b_kernels.json" ;;
sweep_b)  # the curve, the 8K prompt and MTP at the tiles a `sweep` chose (its kernels JSON in OUT)
    step 570 model_b python benchmarks/bench_moe.py --part model --experts pallas --time-budget-s 550 --out "$out" \
        --stages curve,long,mtp --suffix _b --blocks-from "$out/moe_qwen35_35b_a3b_kernels.json" ;;
esac
