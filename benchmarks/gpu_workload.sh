#!/usr/bin/env bash
# GPU measurements of issue 48 (buckets, ragged batches, compile reuse), in two parts that each fit one 10-minute
# device command; each step under its own timeout, results under OUT as they are written.
#   bash benchmarks/gpu_workload.sh a OUT   the 9B cost curve at the current code; new prompt lengths; prefill chunks
#   bash benchmarks/gpu_workload.sh b OUT   the 9B ragged batch curve; a second process; bf16 exactness (tiny Qwen, Huginn)
#   parts c, d: what b's limits cut, streaming; e, f: the forced-acceptance batch curve, exactness with continuation;
#   h: the looped models' exactness with buckets, ragged batches and continuation; i: h and the carried drafter states
#   chunks: the prefill chunk sizes of both families (Huginn-0125 shape; the 9B shape at 8K-128K prompts)
#   curve256: the 9B cost curve at the issue's 256 new tokens (its figures before buckets were taken at 256)
set -u
part=${1:?part a or b}
out=${2:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
. "$(dirname "$0")/gpu_step.sh"
case $part in
curve256)
    step 400 curve256 python benchmarks/bench_spec.py --random-9b --forced-acceptance 1.0 --exact on --rollbacks replay \
        --gammas 2,4,8,16 --repeats 3 --max-new-tokens 256 --prompt-len 256 --time-budget-s 300 --tag _buckets256 \
        --out "$out"
    ;;
chunks)
    step 210 chunks_huginn python benchmarks/bench_workload.py --random-huginn --parts chunks --chunks 256,1024,4096 \
        --chunk-lengths 1000,4000 --chunk-repeats 3 --budget-s 190 --name workload_huginn0125_random_chunks --out "$out"
    step 330 chunks_qwen python benchmarks/bench_workload.py --random-9b --parts chunks --chunks 1024,2048,4096 \
        --chunk-lengths 8192,32768,131072 --chunk-repeats 2 --budget-s 300 --name workload_qwen35_9b_random_chunks_long \
        --out "$out"
    ;;
a)
    step 290 curve python benchmarks/bench_spec.py --random-9b --forced-acceptance 0.8,1.0 --exact on --rollbacks replay \
        --gammas 2,4,8,16 --repeats 3 --max-new-tokens 128 --prompt-len 256 --time-budget-s 90 --tag _buckets \
        --out "$out"
    step 270 lengths_chunks python benchmarks/bench_workload.py --random-9b --parts lengths,chunks \
        --chunks oneshot,256,1024 --chunk-lengths 1000,4000 --budget-s 250 --name workload_qwen35_9b_random_lengths --out "$out"
    ;;
b)
    step 300 batch python benchmarks/bench_workload.py --random-9b --parts batch,second,chunks --batches 1,4,8,16 \
        --chunks oneshot,256,1024 --chunk-lengths 128,256,512 --budget-s 270 --name workload_qwen35_9b_random_batch --out "$out"
    step 140 exact_qwen python benchmarks/bench_workload.py --model checkpoints/tiny-qwen35-code --parts exact \
        --methods ngram,ngram:8,ngram-table,mtp,mtp-shortlist,layer-skip,residual-reuse,partial-mlp --budget-s 120 \
        --name exact_tiny_qwen_buckets --out "$out"
    step 100 exact_huginn python benchmarks/bench_workload.py --model checkpoints/tiny-huginn-code --parts exact \
        --methods self-spec,mature-spec,das-wave --budget-s 80 --name exact_tiny_huginn_buckets --out "$out"
    ;;
c)  # what part b's time limits cut: a second process, short-prompt chunks, the rest of the tiny Qwen's methods
    step 150 second python benchmarks/bench_workload.py --random-9b --parts second --name workload_qwen35_9b_random_second \
        --out "$out"
    step 120 chunks python benchmarks/bench_workload.py --random-9b --parts chunks --chunks oneshot,256,1024 \
        --chunk-lengths 128,512 --budget-s 110 --name workload_qwen35_9b_random_chunks --out "$out"
    [ -n "${SKIP_EXACT:-}" ] || step 280 exact_qwen python benchmarks/bench_workload.py --model checkpoints/tiny-qwen35-code \
        --parts exact --methods mtp,mtp-shortlist,layer-skip,residual-reuse,partial-mlp --budget-s 270 \
        --name exact_tiny_qwen_buckets2 --out "$out"
    ;;
d)  # streaming's cost, a second process, short-prompt chunks (9B shape)
    step 100 stream python benchmarks/bench_workload.py --random-9b --parts stream --name workload_qwen35_9b_random_stream \
        --out "$out"
    step 100 second python benchmarks/bench_workload.py --random-9b --parts second --name workload_qwen35_9b_random_second \
        --out "$out"
    step 75 chunks python benchmarks/bench_workload.py --random-9b --parts chunks --chunks oneshot,256,1024 \
        --chunk-lengths 128,512 --budget-s 65 --name workload_qwen35_9b_random_chunks --out "$out"
    ;;
e)  # the 9B ragged batch curve at forced acceptance p 0.8; bf16 exactness with continuation, tiny Huginn
    step 330 batch python benchmarks/bench_workload.py --random-9b --damp 1 --parts batch --forced-p 0.8 \
        --batches 1,4,8,16 --budget-s 300 --name workload_qwen35_9b_random_batch --out "$out"
    step 200 exact_huginn python benchmarks/bench_workload.py --model checkpoints/tiny-huginn-code --parts exact \
        --skip-batch1 --methods self-spec,mature-spec,das-wave --budget-s 180 --name exact_tiny_huginn_continue \
        --out "$out"
    ;;
g)  # what part e's limits cut: the batch curve at B = 16; exactness with continuation, tiny Huginn
    step 200 batch16 python benchmarks/bench_workload.py --random-9b --damp 1 --parts batch --forced-p 0.8 \
        --batches 16 --budget-s 150 --name workload_qwen35_9b_random_batch16 --out "$out"
    step 150 exact_huginn python benchmarks/bench_workload.py --model checkpoints/tiny-huginn-code --parts exact \
        --skip-batch1 --methods self-spec,mature-spec,das-wave --budget-s 130 --name exact_tiny_huginn_continue \
        --out "$out"
    ;;
h)  # bf16 exactness of the bucketed looped models: natural-length prompts, batch 1, one ragged batch, continuation
    step 220 exact_huginn python benchmarks/bench_workload.py --model checkpoints/tiny-huginn-code --parts exact \
        --methods self-spec,mature-spec,das-wave --budget-s 190 --name exact_tiny_huginn_buckets --out "$out"
    ;;
i)  # bf16 exactness with continuation for the drafters that carry their state (and its acceptance against a
    # restarted drafter); the looped models bucketed (part h)
    step 200 exact_qwen python benchmarks/bench_workload.py --model checkpoints/tiny-qwen35-code --parts exact \
        --skip-batch1 --methods mtp,mtp-shortlist,layer-skip,residual-reuse,partial-mlp --budget-s 180 \
        --name exact_tiny_qwen_continue_carry --out "$out"
    step 220 exact_huginn python benchmarks/bench_workload.py --model checkpoints/tiny-huginn-code --parts exact \
        --methods self-spec,mature-spec,das-wave --budget-s 190 --name exact_tiny_huginn_buckets --out "$out"
    ;;
f)  # bf16 exactness with continuation, tiny Qwen, every chain method; cuDNN attention against the flash kernel
    step 450 exact_qwen python benchmarks/bench_workload.py --model checkpoints/tiny-qwen35-code --parts exact \
        --skip-batch1 --methods ngram,ngram-table,mtp,mtp-shortlist,layer-skip,residual-reuse,partial-mlp \
        --budget-s 400 --name exact_tiny_qwen_continue --out "$out"
    # issue 50's experiment: cuDNN's fused attention against the flash kernel on a prefill chunk
    step 120 cudnn python benchmarks/bench_long_context.py --kernel --cudnn --lengths 4096,32768,131072 \
        --flash-blocks "128,64,8,2"
    ;;
esac
