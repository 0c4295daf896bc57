#!/usr/bin/env bash
# The GPU runs behind the headline index (benchmarks/headline.json) and the docs, one part per 10-minute device
# command. Each step runs under its own `timeout` and writes its JSON / Markdown as it goes; everything under
# OUT_DIR/PART is packed into OUT_DIR/PART.tgz at the end. BENCH_GIT_COMMIT should hold the commit where the copy
# has no .git.
#
#   bash benchmarks/gpu_suite.sh PART OUT_DIR
#
#   qwen-curve    headline qwen9b-step-cost: the 9B-shape forced-acceptance cost curve (random bf16 weights)
#   tiny-qwen     headline tiny-qwen-e2e: the shipped tiny Qwen end to end, 8 held-out prompts
#   tiny-huginn   headline tiny-huginn-e2e: the looped methods against AR (and DAS-Wave at R = 32)
#   looped-curve  headline huginn0125-looped-cost: the looped methods' forced curve at the Huginn-0125 shape
#   exact         headline bf16-exact-ragged: bf16 equality with AR, batch 1 and ragged, both shipped checkpoints
#   workload      headline warm-bucket: new prompt lengths in a warm bucket, prefill chunks (benchmarks/gpu_workload.sh
#                 has the rest of that workload: ragged batches, a second process, streaming)
#   ar            AR alone at the 9B (against transformers) and Huginn-0125 shapes: the baselines
#   compile       one generate() call's compile time per method, both shipped checkpoints and the 9B shape
#   train         the corpus from this machine's Python, the two shipped checkpoints trained on it, the draft tables
#
# Needs: build/corpus (carried, or built by `train`) for nothing but `train`; torch + transformers for `ar`.
set -u
part=${1:?part: qwen-curve | tiny-qwen | tiny-huginn | looped-curve | exact | workload | ar | compile | train}
out=${2:?output folder}
dir="$out/$part"
mkdir -p "$dir"
export PYTHONUNBUFFERED=1
out=$dir
. "$(dirname "$0")/gpu_step.sh"
case "$part" in
qwen-curve)
    step 290 curve_9b python benchmarks/bench_spec.py --random-9b --forced-acceptance 0.8,1.0 --exact on \
        --rollbacks replay --gammas 2,4,8,16 --repeats 3 --max-new-tokens 128 --prompt-len 256 --time-budget-s 100 \
        --tag _buckets --out "$dir"
    ;;
tiny-qwen)
    step 300 e2e_default python benchmarks/bench_spec.py --model checkpoints/tiny-qwen35-code --skip-steps \
        --max-new-tokens 128 --prompts benchmarks/prompts/heldout_stdlib.json --num-prompts 8 \
        --e2e-methods ngram:4,ngram:8,mtp:4 --tag _loop_form --out "$dir"
    ;;
tiny-huginn)
    step 120 exact_huginn python benchmarks/bench_exact.py --part tiny --models huginn --modes exact \
        --num-prompts 8 --prompt-len 64 --tag _huginn_bptt --out "$dir"
    step 140 looped_dw python benchmarks/bench_looped_spec.py --grid small --methods das-wave --num-prompts 8 \
        --time-budget-s 110 --out "$dir"
    ;;
looped-curve)
    step 240 looped_curve python benchmarks/bench_looped_curve.py --max-new-tokens 48 --repeats 1 --time-budget-s 200 \
        --das-ps 0.5,0.8,0.9,0.95,0.97,0.98,1.0 --ps 0.5,0.8,1.0 --out "$dir"
    ;;
exact)
    step 280 exact_qwen python benchmarks/bench_workload.py --model checkpoints/tiny-qwen35-code --parts exact \
        --methods mtp,mtp-shortlist,layer-skip,residual-reuse,partial-mlp --budget-s 270 \
        --name exact_tiny_qwen_buckets2 --out "$dir"
    step 100 exact_huginn python benchmarks/bench_workload.py --model checkpoints/tiny-huginn-code --parts exact \
        --methods self-spec,mature-spec,das-wave --budget-s 80 --name exact_tiny_huginn_buckets --out "$dir"
    ;;
workload)
    step 270 lengths_chunks python benchmarks/bench_workload.py --random-9b --parts lengths,chunks \
        --chunks oneshot,256,1024 --chunk-lengths 1000,4000 --budget-s 250 --name workload_qwen35_9b_random_lengths \
        --out "$dir"
    ;;
ar)
    export XLA_PYTHON_CLIENT_PREALLOCATE=false  # torch shares the GPU
    step 330 ar_9b python benchmarks/bench_qwen35.py --out "$dir"
    unset XLA_PYTHON_CLIENT_PREALLOCATE
    step 150 ar_huginn python benchmarks/bench_looped.py --out "$dir"
    ;;
compile)
    step 150 compile_qwen python benchmarks/bench_compile.py --model checkpoints/tiny-qwen35-code --time-budget-s 110 \
        --out "$dir"
    step 80 compile_huginn python benchmarks/bench_compile.py --model checkpoints/tiny-huginn-code --time-budget-s 50 \
        --out "$dir"
    step $(( ${COMPILE_END_S:-540} - SECONDS )) compile_9b python benchmarks/bench_compile.py --random-9b \
        --methods ar,ngram,layer-skip --time-budget-s 100 --out "$dir"
    ;;
train)  # three processes share the GPU (Qwen + MTP head, Huginn); the checkpoints come back as tar parts of <= 15 MiB.
    # The shipped Huginn was then continued with backprop through the whole recurrence (docs/LOG.md, 2026-12-03) and
    # the Qwen MTP head trained for chained drafting (scripts/train_mtp_head.py). Smoke on CPU:
    # CORPUS_ARGS="--max-train-chars 3e6 --tokenizer-chars 1e6" TRAIN_ARGS="--batch 2 --seq-len 64 --hidden 64
    #   --intermediate 128" TABLE_ARGS="--prompts 4 --batch 4 --new-tokens 8" TRAIN_END_S=60
    step 260 corpus python scripts/build_corpus.py --out build/corpus ${CORPUS_ARGS:-}
    budget=$(( ${TRAIN_END_S:-400} - SECONDS ))
    (( budget < 60 )) && budget=60
    echo "training budget ${budget} s per run" | tee -a "$dir/suite.log"
    common=(--corpus build/corpus --batch 128 --seq-len 512 --lr 3e-3 --steps 200000 --time-budget-s "$budget"
            --eval-every 400 --eval-max-tokens 262144 --keep-best --log-every 100 ${TRAIN_ARGS:-})
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
    limit=$(( 555 - SECONDS ))
    step "$limit" train_qwen python scripts/train_tiny.py --arch qwen35 --mtp-distill 0.5 \
        --out "$dir/ck/tiny-qwen35-code" "${common[@]}" &
    step "$limit" train_huginn python scripts/train_tiny.py --arch huginn --prelude 2 --core 2 --coda 2 \
        --intermediate 1024 --mean-recurrence 16 --backprop-depth 8 --out "$dir/ck/tiny-huginn-code" "${common[@]}" &
    wait
    unset XLA_PYTHON_CLIENT_MEM_FRACTION
    step 60 draft_tables python scripts/build_draft_tables.py --model "$dir/ck/tiny-qwen35-code" --corpus build/corpus \
        ${TABLE_ARGS:-}
    cp build/corpus/manifest.json build/corpus/LICENSES.md "$dir/" 2>/dev/null
    tar czf "$out/ck.tgz" -C "$dir" ck && split -b 15m -d "$out/ck.tgz" "$out/ck.tgz.part" && rm "$out/ck.tgz" \
        && rm -rf "$dir/ck"
    ;;
*)
    echo "unknown part $part" >&2
    exit 2
    ;;
esac
tar czf "$out/$part.tgz" -C "$out" "$part"
