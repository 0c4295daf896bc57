#!/usr/bin/env bash
# GPU measurements of issue 50 (long prompts), each step under its own timeout, results under OUT as they are written.
#   bash benchmarks/gpu_long_context.sh kernel OUT   flash tile settings against XLA; 1K and 32K end to end; tiny bf16 at 32K
#   bash benchmarks/gpu_long_context.sh table1 OUT   benchmarks/results/long_context_qwen35_9b.json, 1K..32K
#   bash benchmarks/gpu_long_context.sh cudnn OUT    the flash kernel against the cuDNN path by length, then table2
#   bash benchmarks/gpu_long_context.sh table2 OUT   ... 64K and 128K (the two halves fit one 10-minute device command each;
#                                                 benchmarks/merge_long_context.py joins them)
set -u
part=${1:?part kernel or table}
out=${2:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
. "$(dirname "$0")/gpu_step.sh"
case $part in
kernel)
    step 170 kernel python benchmarks/bench_long_context.py --kernel --lengths 4096,32768,131072 \
        --flash-blocks "64,64,4,2;64,64,8,2;128,64,8,2;64,32,4,3;128,32,8,2;32,64,4,2;128,128,8,2"
    step 110 exact_tiny python benchmarks/bench_long_context.py --exact-len 32000 --new-tokens 128 --out "$out"
    step 150 bench python benchmarks/bench_long_context.py --lengths 1024 --repeats 1 --time-budget-s 140 \
        --tag probe --out "$out"
    ;;
table)  # one command: the lengths longest first (a time limit cuts the short ones), one timed round each
    step 585 table python benchmarks/bench_long_context.py --lengths 131072,65536,32768,16384,4096,1024 --repeats 1 \
        --time-budget-s 575 --out "$out"
    ;;
cudnn)  # the prefill chunk's attention: the flash kernel's tiles against the cuDNN path (CUDNN_MIN_CACHE), then table2
    step 150 kernel python benchmarks/bench_long_context.py --kernel --lengths 4096,8192,16384,32768,131072 \
        --flash-blocks "128,64,8,2" --cudnn --xla-limit 8192
    step 330 table2 python benchmarks/bench_long_context.py --lengths 65536,131072 --time-budget-s 320 --tag part2 \
        --out "$out"
    step 100 exact_tiny python benchmarks/bench_long_context.py --exact-len 32000 --new-tokens 128 --out "$out"
    ;;
table1)
    step 570 table1 python benchmarks/bench_long_context.py --lengths 1024,4096,16384,32768 --time-budget-s 560 \
        --tag part1 --out "$out"
    ;;
table2)
    step 470 table2 python benchmarks/bench_long_context.py --lengths 65536,131072 --time-budget-s 460 --tag part2 \
        --out "$out"
    step 100 exact_tiny python benchmarks/bench_long_context.py --exact-len 32000 --new-tokens 128 --out "$out"
    ;;
esac
