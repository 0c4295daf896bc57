#!/usr/bin/env bash
# The GPU measurements still owed by open issues, in parts that each fit one 10-minute device command.
#
#   bash scripts/gpu_suite.sh PART OUT_DIR        PART in: decode, curve, final, tiny, exact, exact-curve, gdn, qwen,
#                                                  ab, tune, looped, looped-grid, exact-all, qwen-all,
#                                                  looped-scale, reuse, train,
#                                                  train-huginn, retrained, selfdraft, profile, graphs,
#                                                  replay, current, train-depth, live, live-check, preload, rolled,
#                                                  rolled-curve, rolled-check, waits, nocb, replay-kept,
#                                                  loop-forms, loop-forms-tiny, stacked, stacked-check, train-depth-floor,
#                                                  convstack, fixedcost, fixedcost-trace, cmdbuf,
#                                                  cbwhile, cbmodes, concurrent, tune-replay, cbmodes2,
#                                                  unroll, loops, fp32, fp32-check, looped-unroll, fp32-curve,
#                                                  fp32-g16, stash, stash-check, stash-bits, repeat-procs, strict-xla,
#                                                  exact-options, exact-options-cost, looped-options,
#                                                  thunks, looped-curve-options, recycle,
#                                                  mtp-blocks, mtp-final, mtp-splits, mtp-gather, mtp-defaults,
#                                                  mtp-fuse, mtp-chain, mtp-chain-check, compile, pseudo-replay,
#                                                  pseudo-replay-tune, pseudo-replay-check, head, defer, defer-check,
#                                                  packed-form, packed-form-check, packed-form-curve, unroll-form,
#                                                  step-block, sure-steps, fetch-first, step-ncu, loop-form, loop-form-default,
#                                                  train-bptt, huginn-bptt-check, train-depth-curve
#
# Needs: fla-core 0.6.0 on PYTHONPATH for `gdn` (carried wheel), build/corpus (carried) for `qwen`.
# Every benchmark runs under its own `timeout` and writes its JSON/Markdown as it goes; everything
# under OUT_DIR/PART is packed into OUT_DIR/PART.tgz at the end (the device returns at most 8 files).
# BENCH_GIT_COMMIT should hold the commit (the device copy has no .git).
set -u
part=${1:?part: decode | curve | final | tiny | exact | exact-curve | gdn | qwen | ab | tune | looped | looped-grid | exact-all | qwen-all | looped-scale | reuse | train | train-huginn | retrained | selfdraft | profile | graphs | replay | current | train-depth | live | live-check | preload | rolled | rolled-curve | rolled-check | waits | nocb | replay-kept | loop-forms | loop-forms-tiny | stacked | stacked-check | train-depth-floor | convstack | fixedcost | fixedcost-trace | cmdbuf | cbwhile | cbmodes | concurrent | tune-replay | cbmodes2 | unroll | loops | fp32 | fp32-check | looped-unroll | fp32-curve | fp32-g16 | stash | stash-check | stash-bits | repeat-procs | strict-xla | exact-options | exact-options-cost | looped-options | thunks | looped-curve-options | recycle | mtp-blocks | mtp-final | mtp-splits | mtp-gather | mtp-defaults | mtp-fuse | mtp-chain | mtp-chain-check | compile | pseudo-replay | pseudo-replay-tune | pseudo-replay-check | head | defer | defer-check | packed-form | packed-form-check | packed-form-curve | unroll-form | step-block | sure-steps | fetch-first | step-ncu | loop-form | loop-form-default | train-bptt | huginn-bptt-check | train-depth-curve}
out=${2:?output folder}
dir="$out/$part"
mkdir -p "$dir"
export PYTHONUNBUFFERED=1
step() {  # step SECONDS NAME command...: run with a time limit, log to NAME.log
    local limit=$1 name=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$dir/$name.log" 2>&1
    echo "$name: rc=$? after $((SECONDS - t0)) s (limit $limit)" | tee -a "$dir/suite.log"
}
huginn_layouts() {  # END_S LIMIT_END LOG_PREFIX CK_PREFIX [train args...]: build the corpus, then train the 2+2+2
    # (recurrence mean 16, backprop 8) and 1+4+1 (backprop 4) Huginn layouts side by side until END_S (seconds since
    # the part started), each killed at LIMIT_END; checkpoints under $dir/ck/CK_PREFIX-222 and -141
    local end_s=$1 limit_end=$2 log_prefix=$3 ck_prefix=$4
    shift 4
    step 200 corpus python scripts/build_corpus.py --out build/corpus --tokenizer checkpoints/tiny-qwen35-code \
        ${CORPUS_ARGS:-}
    local budget=$(( end_s - SECONDS ))
    (( budget < 60 )) && budget=60
    echo "training budget ${budget} s per run" | tee -a "$dir/suite.log"
    local common=(--arch huginn --corpus build/corpus --batch 128 --seq-len 512 --lr 3e-3 --steps 200000
                  --time-budget-s "$budget" --eval-every 400 --eval-max-tokens 262144 --keep-best --log-every 100
                  --intermediate 1024 "$@" ${TRAIN_ARGS:-})
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
    local limit=$(( limit_end - SECONDS ))
    step "$limit" "${log_prefix}_222" python scripts/train_tiny.py --prelude 2 --core 2 --coda 2 --mean-recurrence 16 \
        --backprop-depth 8 --out "$dir/ck/$ck_prefix-222" "${common[@]}" &
    step "$limit" "${log_prefix}_141" python scripts/train_tiny.py --prelude 1 --core 4 --coda 1 --mean-recurrence 16 \
        --backprop-depth 4 --out "$dir/ck/$ck_prefix-141" "${common[@]}" &
    wait
}
tiny_e2e_short_long() {  # LIMIT_SHORT LIMIT_LONG SHORT_TAG LONG_TAG SHORT_METHODS LONG_METHODS: the shipped tiny Qwen end
    # to end on 8 held-out 64-token prompts and on 4 held-out 1024-token files, 128 new tokens each
    local e2e=(--model checkpoints/tiny-qwen35-code --skip-steps --max-new-tokens 128)
    step "$1" e2e_default python scripts/bench_spec.py "${e2e[@]}" --prompts benchmarks/prompts/heldout_stdlib.json \
        --num-prompts 8 --e2e-methods "$5" --tag "$3" --out "$dir"
    step "$2" e2e_long python scripts/bench_spec.py "${e2e[@]}" --prompts heldout-files --num-prompts 4 --prompt-len 1024 \
        --e2e-methods "$6" --tag "$4" --out "$dir"
}
process_waves() {  # LETTER TAG ODD_OPTIONS EVEN_OPTIONS: eight fresh processes, four at a time on the one GPU (their
    # autotuning timed under contention), each generating 4 prompts twice by AR and by n-gram speculation with its
    # loops' optimized HLO dumped (odd / even processes with SPECDEC_XLA_OPTIONS set as given); then the loops' GEMM and
    # Triton computations compared within and across processes (compare_hlo_dumps.py)
    local letter=$1 tag=$2 odd=$3 even=$4
    export XLA_PYTHON_CLIENT_PREALLOCATE=false  # four 9B models (each 31 GB at its peak while made) on one GPU
    for wave in 0 1; do
        for j in 1 2 3 4; do
            local i=$((wave * 4 + j))
            SPECDEC_XLA_OPTIONS="$([ $((i % 2)) -eq 0 ] && echo "$even" || echo "$odd")" \
            XLA_FLAGS="--xla_dump_to=/tmp/hlo_$letter$i --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*(decode_loop|spec_loop).*" \
                step 230 "repeat_$letter$i" python scripts/check_repeatability.py --num-prompts 4 --repeats 2 \
                --programs ar,default --tag "${tag}_p$i" --out "$dir" &
        done
        wait
    done
    unset XLA_PYTHON_CLIENT_PREALLOCATE
    for i in 1 2 3 4 5 6 7 8; do
        mkdir -p "$dir/hlo_$letter$i" && cp /tmp/hlo_$letter$i/*_loop*gpu_after_optimizations.txt "$dir/hlo_$letter$i/" 2>/dev/null
    done
    step 60 compare_hlo python scripts/compare_hlo_dumps.py "$dir"/hlo_$letter{1,2,3,4,5,6,7,8}
}
case "$part" in
fp32)  # issue 12: float32 at precision "highest": the forms of a few-row product at the 9B shapes (XLA's IEEE GEMM,
    # a float32 row reduction output- or row-major, the multi-pass tensor-core algorithms), then the 9B verification
    # and the exact path's 8-row AR step with the library's auto rule (multi-row float32 products as the reduction)
    # against the GEMM
    step 240 matmul_forms python scripts/bench_matmul_forms.py --out "$dir"
    step 330 profile_9b_fp32 python scripts/profile_spec_step.py --random-9b --dtype float32 --precision highest \
        --pieces ar,verify --gammas 8 --matvec-modes auto,dot --ar-rows 8 --variants pallas --time-budget-s 270 \
        --tag _reduce --out "$dir"
    ;;
fp32-curve)  # issue 12: the 9B forced-acceptance curve in float32 at precision "highest" (exact path, replay), each
    # setting paired with exact AR in the same run; then the few-row product forms past 16 rows (17, 32)
    step 320 curve_9b_fp32 python scripts/bench_spec.py --random-9b --dtype float32 --precision highest \
        --forced-acceptance 0.6,0.8,1.0 --gammas 4,8 --rollbacks replay --exact on --repeats 2 --max-new-tokens 128 \
        --prompt-len 256 --time-budget-s 280 --out "$dir"
    step 100 matmul_forms python scripts/bench_matmul_forms.py --rows 17,32 --forms dot,tf32x3 --tag _rows17_32 \
        --out "$dir"
    ;;
stash)  # issue 12: SPECDEC_GDN_REPLAY_STASH=1 (the verification's GDN kernels store their inputs into the replay's
    # stacks: no input stacking in the commit; measured at dcdbbaa as part stash3): the 9B steps kernel by kernel, the
    # 9B cost curve, then bf16 equality on the shipped Qwen (every chain method); stash-check: at the 9B shape
    SPECDEC_GDN_REPLAY_STASH=1 step 150 profile_9b python scripts/bench_spec.py --random-9b --forced-acceptance 1.0 \
        --exact on --curve-method ngram --rollbacks replay --gammas 2,8,16 --repeats 1 --max-new-tokens 64 \
        --prompt-len 256 --kernel-profile --tag _stash_on_profile --out "$dir"
    SPECDEC_GDN_REPLAY_STASH=1 step 190 curve_9b python scripts/bench_spec.py --random-9b --forced-acceptance 0.8,1.0 \
        --exact on --rollbacks replay --gammas 2,4,8,16 --repeats 2 --max-new-tokens 128 --prompt-len 256 \
        --time-budget-s 150 --tag _stash_on --out "$dir"
    SPECDEC_GDN_REPLAY_STASH=1 step 120 exact_qwen python scripts/bench_exact.py --part tiny --models qwen \
        --num-prompts 8 --prompt-len 64 --modes exact --tag _qwen_stash_on --out "$dir"
    ;;
stash-check)  # issue 12: bf16 equality with AR at the 9B shape at gamma 16, SPECDEC_GDN_REPLAY_STASH on and off
    for flag in 1 0; do
        SPECDEC_GDN_REPLAY_STASH=$flag step 250 "exact_9b_g16_$flag" python scripts/bench_exact.py --part 9b \
            --num-prompts 2 --gamma 16 --ar-rows 17 --repeats 1 --tag "_stash_${flag}_g16" --out "$dir"
    done
    ;;
stash-bits)  # issue 12: the stash bit by bit at the 9B shape (check_stash_bits.py: logits and committed states of
    # the stash-off, stash-on and AR chains, step by step), then bf16 equality with the switch on at gamma 16
    step 230 stash_bits python scripts/check_stash_bits.py --steps 64 --ar-steps 40 --out "$dir"
    SPECDEC_GDN_REPLAY_STASH=1 step 280 exact_9b_g16_1 python scripts/bench_exact.py --part 9b --num-prompts 2 \
        --gamma 16 --ar-rows 17 --repeats 1 --tag _stash_1_g16 --out "$dir"
    ;;
repeat-procs)  # the exact path's bf16 equality at the 9B shape varies between processes (repeatability_*.md): eight
    # fresh processes, four at a time on the one GPU (their autotuning timed under contention, as varied as it gets),
    # each generating 4 prompts twice by AR and by n-gram speculation (the stash as by default) with the optimized HLO
    # of its loops dumped; odd ones with the default CONCURRENT command-buffer schedule, even ones with XLA's own
    # (SPECDEC_XLA_OPTIONS=none), XLA's defaults otherwise (as before compiled.EXACT_GPU_OPTIONS); then compared
    process_waves p "" "xla_gpu_command_buffer_scheduling_mode=CONCURRENT" none
    grep -H "| ngram |" "$dir"/repeatability_*_p*.md | sed "s|.*/repeatability_||" | head -40
    ;;
strict-xla)  # the exact path's bf16 equality between processes (repeat-procs: under contention 6 of 8 processes gave
    # 1-4 prompts of 4 unlike AR, both command-buffer schedules; within each, AR and spec share every GEMM configuration,
    # but the split-K partial sums and the GDN gates are recomputed in fusions that XLA's fusion autotuner makes
    # native in one loop and Triton in the other, differently per process). Candidate options: no fusion autotuner,
    # no split-K, no excess precision; each checked to compile first, then eight processes four at a time as in
    # repeat-procs with them, then their cost per step beside the default in one process (bench_fixed_cost)
    strict=$(python - <<'PY'
import jax, jax.numpy as jnp
wanted = {"xla_gpu_experimental_enable_fusion_autotuner": "False", "xla_gpu_experimental_force_split_k": "1",
          "xla_allow_excess_precision": "False"}
ok = []
for k, v in wanted.items():
    try:
        jax.jit(lambda x: x * 2 + 1).lower(jnp.ones(8)).compile(compiler_options={k: v})
        ok.append(f"{k}={v}")
    except Exception as e:  # an option this jaxlib does not know
        print(f"dropped {k}: {str(e)[:200]}", file=__import__("sys").stderr)
print(";".join(ok))
PY
)
    strict=${STRICT_OPTIONS:-$strict}  # another set to check the same way (tags: STRICT_TAG)
    echo "strict options: $strict" | tee -a "$dir/suite.log"
    process_waves s "_strict${STRICT_TAG:-}" "xla_gpu_command_buffer_scheduling_mode=CONCURRENT;$strict" \
        "xla_gpu_command_buffer_scheduling_mode=CONCURRENT;$strict"
    [ -z "${STRICT_SKIP_COST:-}" ] && step 230 cost_9b python scripts/bench_fixed_cost.py --random-9b --gamma 8 \
        --tokens 24,192 --repeats 3 --loop-option "$strict" --tag _strict --out "$dir"
    grep -H "| ngram |" "$dir"/repeatability_*_p*.md | sed "s|.*/repeatability_||" | head -40
    tail -20 "$dir"/fixed_cost_*_strict.md
    ;;
exact-options)  # the exactness options the default (compiled.EXACT_GPU_OPTIONS, every family): the 9B cost curve paired
    # with AR, the shipped Qwen end to end (n-gram, MTP), and bf16 equality with AR of every chain method (shipped Qwen)
    # and every looped method (shipped Huginn) at this code
    step 180 curve_9b python scripts/bench_spec.py --random-9b --forced-acceptance 0.8,1.0 --exact on \
        --rollbacks replay --gammas 2,4,8,16 --repeats 2 --max-new-tokens 128 --prompt-len 256 --time-budget-s 140 \
        --tag _exact_options --out "$dir"
    step 100 e2e_tiny python scripts/bench_spec.py --model checkpoints/tiny-qwen35-code --skip-steps \
        --prompts benchmarks/prompts/heldout_stdlib.json --num-prompts 8 --max-new-tokens 128 \
        --e2e-methods ngram:4,ngram:8,mtp:3 --tag _exact_options --out "$dir"
    step 110 exact_qwen python scripts/bench_exact.py --part tiny --models qwen --num-prompts 8 --prompt-len 64 \
        --modes exact --tag _qwen_exact_options --out "$dir"
    step 110 exact_huginn python scripts/bench_exact.py --part tiny --models huginn --num-prompts 8 --prompt-len 64 \
        --modes exact --tag _huginn_exact_options --out "$dir"
    ;;
exact-options-cost)  # what each exactness option costs (compiled.EXACT_GPU_OPTIONS, the default): both loops with one
    # option set back to XLA's default, each variant timed beside the default in one process, tiny checkpoint and 9B
    back="xla_gpu_experimental_enable_fusion_autotuner=True"
    split="xla_gpu_experimental_force_split_k=0"
    excess="xla_allow_excess_precision=True"
    step 150 cost_tiny python scripts/bench_fixed_cost.py --model checkpoints/tiny-qwen35-code --prompt-len 64 \
        --gamma 8 --tokens 24,192 --repeats 3 --loop-option "$back" --loop-option "$split" --loop-option "$excess" \
        --tag _exact_options_each --out "$dir"
    step 260 cost_9b python scripts/bench_fixed_cost.py --random-9b --gamma 8 --tokens 24,192 --repeats 3 \
        --loop-option "$back" --loop-option "$split" --loop-option "$excess" --tag _exact_options_each --out "$dir"
    grep -h "^| ar\|^| spec" "$dir"/fixed_cost_*_each.md | grep -v "| 24 \|| 192 "
    ;;
thunks)  # issue 12: where a speculative step's time outside kernels goes (the spec loop runs host-driven, AR's not):
    # XLA's thunk sequences of both loops, before and after its thunk passes (which build the command buffers), 9B
    # (compiled only) and tiny (timed too), then the 9B kernel profile at gamma 2 / 8 / 16 under the exactness options
    dre='.*_(spec|decode)_loop.*'
    XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$dir/dump9b --xla_dump_hlo_module_re=$dre" step 150 hlo_9b \
        python scripts/bench_fixed_cost.py --random-9b --gamma 8 --tokens 24,96 --hlo --hlo-only --tag _thunks \
        --out "$dir"
    XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$dir/dumptiny --xla_dump_hlo_module_re=$dre" step 100 hlo_tiny \
        python scripts/bench_fixed_cost.py --model checkpoints/tiny-qwen35-code --prompt-len 64 --gamma 8 \
        --tokens 24,96 --repeats 3 --hlo --tag _thunks --out "$dir"
    find "$dir/dump9b" "$dir/dumptiny" -type f ! -name '*thunk*' ! -name '*after_optimizations.txt' -delete
    ls -la "$dir"/dump9b | head -20
    step 170 profile_9b python scripts/bench_spec.py --random-9b --forced-acceptance 1.0 --exact on \
        --curve-method ngram --rollbacks replay --gammas 2,8,16 --repeats 1 --max-new-tokens 64 --prompt-len 256 \
        --kernel-profile --tag _exact_options_profile --out "$dir"
    ;;
looped-curve-options)  # the looped family's forced cost curve at the Huginn-0125 shape now compiled with the family's
    # exactness options (the default since d39d21b; the row in the README predates them), then looped-options
    step 240 looped_curve python scripts/bench_looped_curve.py --max-new-tokens 48 --repeats 1 --time-budget-s 200 \
        --das-ps 0.5,0.8,0.9,0.95,0.97,0.98,1.0 --ps 0.5,0.8,1.0 \
        --tiny-acceptance benchmarks/results/looped_spec_tiny-huginn-code_r32_20261201_174439.json --out "$dir"
    bash "$0" looped-options "$out"
    ;;
recycle)  # issue 12: is a call's fixed cost (1.7-2.0 ms per 9B call) XLA updating the loop's command buffers for new
    # state buffers? Each loop also timed with its prefill writing over the previous call's final state (donated), so
    # every call gets the same buffers (bench_fixed_cost.py --recycle), beside the default, tiny and 9B
    step 120 recycle_tiny python scripts/bench_fixed_cost.py --model checkpoints/tiny-qwen35-code --prompt-len 64 \
        --gamma 8 --tokens 24,96,192 --repeats 5 --recycle --tag _recycle --out "$dir"
    step 200 recycle_9b python scripts/bench_fixed_cost.py --random-9b --gamma 8 --tokens 24,192 --repeats 3 \
        --recycle --tag _recycle --out "$dir"
    grep -h "distinct" "$dir"/*.log
    grep -h "^| ar\|^| spec" "$dir"/fixed_cost_*_recycle.md | grep -v "| 24 \|| 96 \|| 192 "
    ;;
looped-options)  # the exactness options on the looped family (tiny Huginn's AR was 12% slower under them,
    # exact_tiny_huginn_exact_options.md): the exact path, AR and every lossless looped method, with each option set back
    # alone (its own process each; speed and equality with AR)
    exact="xla_gpu_experimental_enable_fusion_autotuner=False;xla_gpu_experimental_force_split_k=1;xla_allow_excess_precision=False"
    step 120 exact_huginn_default python scripts/bench_exact.py --part tiny --models huginn --modes exact \
        --num-prompts 8 --prompt-len 64 --tag _huginn_options_default --out "$dir"  # the baseline, same machine
    for variant in "autotuner:${exact/enable_fusion_autotuner=False/enable_fusion_autotuner=True}" \
                   "splitk:${exact/force_split_k=1/force_split_k=0}" \
                   "excess:${exact/excess_precision=False/excess_precision=True}" "none:none"; do
        SPECDEC_XLA_OPTIONS="${variant#*:}" step 120 "exact_huginn_${variant%%:*}" python scripts/bench_exact.py \
            --part tiny --models huginn --modes exact --num-prompts 8 --prompt-len 64 \
            --tag "_huginn_options_back_${variant%%:*}" --out "$dir"
    done
    ;;
fp32-g16)  # issue 12: the 9B float32 curve at gamma 16 (17-row products as TF32x3), paired with exact AR; then the
    # shipped Qwen end to end (n-gram, MTP) at this code
    step 330 curve_9b_fp32 python scripts/bench_spec.py --random-9b --dtype float32 --precision highest \
        --forced-acceptance 0.8,1.0 --gammas 16 --rollbacks replay --exact on --repeats 2 --max-new-tokens 128 \
        --prompt-len 256 --time-budget-s 290 --tag _g16 --out "$dir"
    step 110 e2e_tiny python scripts/bench_spec.py --model checkpoints/tiny-qwen35-code --skip-steps \
        --prompts benchmarks/prompts/heldout_stdlib.json --num-prompts 8 --max-new-tokens 128 \
        --e2e-methods ngram:4,ngram:8,mtp:3 --tag _recheck --out "$dir"
    ;;
looped-unroll)  # the looped family's depth loop (a lax.scan nested in every decode step: host-driven on the GPU, one
    # round trip per recurrence step) rolled, unrolled by 4 and 8, and unrolled in full: tiny Huginn at r = 16 (its
    # default), exact path, AR and every lossless looped method, speed, compile seconds and equality with AR
    for u in 1 full 4 8; do
        SPECDEC_RECURRENCE_UNROLL=$u step 130 "exact_huginn_unroll_$u" python scripts/bench_exact.py --part tiny \
            --models huginn --modes exact --num-prompts 8 --prompt-len 64 --tag "_huginn_unroll_$u" --out "$dir"
    done
    ;;
fp32-check)  # issue 12: float32 at "highest" with few-row products as TF32x3 (the auto rule) against XLA's IEEE GEMM:
    # the 9B verification and AR steps, then greedy speculative output against AR at the 9B shape in float32 (n-gram
    # and forced drafts, exact and fast paths) with AR's speed at 1, 8, 9 and 16 decode rows
    step 200 profile_9b_fp32 python scripts/profile_spec_step.py --random-9b --dtype float32 --precision highest \
        --pieces ar,verify --gammas 8 --matvec-modes auto,dot --ar-rows 8 --variants pallas --time-budget-s 170 \
        --tag _tf32x3 --out "$dir"
    step 360 exact_9b_fp32 python scripts/bench_exact.py --part 9b --dtype float32 --precision highest \
        --num-prompts 2 --repeats 3 --out "$dir"
    ;;
loops)  # issue 12: the other loops nested in a decode step, each host-driven on the GPU: ngram-table's binary search
    # (jnp.searchsorted's default "scan", 15 steps per lookup) against compare_all / scan_unrolled, and the self-drafts'
    # chain (gamma 3) unrolled against a lax.scan, tiny checkpoint end to end beside AR; then bf16 equality with AR of
    # every chain method at this code; layer-skip's chain at the 9B shape (compile seconds and step cost, gamma 4)
    step 200 e2e_tiny python scripts/bench_spec.py --model checkpoints/tiny-qwen35-code --skip-steps \
        --prompts benchmarks/prompts/heldout_stdlib.json --num-prompts 8 --max-new-tokens 128 \
        --e2e-methods "ngram-table:4,ngram-table:4:search='scan_unrolled',ngram-table:4:search='scan',layer-skip:3,layer-skip:3:unroll_drafts=False,mtp:3" \
        --tag _loops --out "$dir"
    step 120 exact_qwen python scripts/bench_exact.py --part tiny --models qwen --num-prompts 8 --prompt-len 64 \
        --modes exact --tag _qwen_loops --out "$dir"
    step 190 curve_9b_selfdraft python scripts/bench_spec.py --random-9b --forced-acceptance 1.0 --exact on \
        --curve-method "ngram,layer-skip,layer-skip:unroll_drafts=False" --rollbacks replay --gammas 4 --repeats 2 \
        --max-new-tokens 128 --prompt-len 256 --time-budget-s 170 --tag _loops --out "$dir"
    ;;
unroll)  # issue 12: the replay's block / warp settings (tune-replay, bit-checked), then the MTP drafter's chain
    # unrolled (one command buffer per step) against a lax.scan (a host-driven loop nested in the step) on the tiny
    # checkpoint end to end at gamma 3 and 4 beside AR, then what a call costs per argument array
    step 300 tune python scripts/tune_recurrent.py --lengths 9,17 --preloads True --block-vs 8,16,32 \
        --num-warps 1,2,4 --stack 24 --chain 24 --repeats 5 --out "$dir"
    step 170 e2e_tiny python scripts/bench_spec.py --model checkpoints/tiny-qwen35-code --skip-steps \
        --prompts benchmarks/prompts/heldout_stdlib.json --num-prompts 8 --max-new-tokens 128 \
        --e2e-methods ngram:8,mtp:3,mtp:3:unroll_drafts=False,mtp:4,mtp:4:unroll_drafts=False --tag _unroll \
        --out "$dir"
    step 60 call_overhead python scripts/bench_call_overhead.py --out "$dir"
    ;;
decode)  # issue 12: every piece of a speculative step, each GPU path (defaults' evidence): 9B shape, tiny, fp32
    step 320 profile_9b python scripts/profile_spec_step.py --random-9b --gammas 4,8,16 --step-gammas 8 \
        --time-budget-s 290 --out "$dir"
    step 90 profile_tiny python scripts/profile_spec_step.py --model checkpoints/tiny-qwen35-code --gammas 8 \
        --step-gammas 4,8 --chain 64 --repeats 10 --time-budget-s 80 --out "$dir"
    step 150 profile_9b_fp32 python scripts/profile_spec_step.py --random-9b --dtype float32 --precision highest \
        --pieces ar,verify --gammas 8 --time-budget-s 140 --out "$dir"
    ;;
curve)  # issue 12: the small-T kernel variants (bit-for-bit checks), then the 9B forced-acceptance cost curve
    step 100 tune_recurrent python scripts/tune_recurrent.py --out "$dir"
    step 460 curve_9b python scripts/bench_spec.py --random-9b --forced-acceptance 0.5,0.7,0.8,0.9,1.0 \
        --gammas 2,4,8,16 --repeats 3 --max-new-tokens 128 --prompt-len 256 --time-budget-s 440 --out "$dir"
    ;;
final)  # issue 12: the 9B cost curve, then the tiny checkpoint piece by piece and end to end with real drafts
    step 250 curve_9b python scripts/bench_spec.py --random-9b --forced-acceptance 0.5,0.7,0.8,0.9,1.0 \
        --gammas 2,4,8,16 --repeats 2 --max-new-tokens 128 --prompt-len 256 --time-budget-s 235 --out "$dir"
    step 75 profile_tiny python scripts/profile_spec_step.py --model checkpoints/tiny-qwen35-code --gammas 8 \
        --step-gammas 4,8 --chain 64 --repeats 10 --time-budget-s 70 --out "$dir"
    step 230 e2e_tiny python scripts/bench_spec.py --model checkpoints/tiny-qwen35-code --skip-steps \
        --prompts benchmarks/prompts/heldout_stdlib.json --num-prompts 8 --max-new-tokens 128 \
        --e2e-methods ngram:8,ngram:4,ngram:8/snapshot,mtp:4,mtp:3,mtp-shortlist:4,ngram-table:4 --out "$dir"
    ;;
tiny)  # issue 12: the tiny checkpoint piece by piece and end to end with real drafts
    step 90 profile_tiny python scripts/profile_spec_step.py --model checkpoints/tiny-qwen35-code --gammas 8 \
        --step-gammas 4,8 --chain 64 --repeats 10 --time-budget-s 80 --out "$dir"
    step 250 e2e_tiny python scripts/bench_spec.py --model checkpoints/tiny-qwen35-code --skip-steps \
        --prompts benchmarks/prompts/heldout_stdlib.json --num-prompts 8 --max-new-tokens 128 \
        --e2e-methods ngram:8,ngram:4,ngram:8/snapshot,mtp:4,mtp:3,mtp-shortlist:4,ngram-table:4 --out "$dir"
    ;;
gdn)  # issue 4: T <= 64 recurrent verify + commit vs fla with snapshots, then T = 1024; issue 8: 9B tree steps
    step 330 gdn_small python scripts/bench_gdn.py --out "$dir" --tag h200_smallT --sizes 64,16,4,1,1024 \
        --repeats 10 --skip-ceilings
    step 220 tree9b python scripts/bench_tree.py --random-9b --skip-e2e --nodes 8,16,32,64 --shapes bushy,chain \
        --repeats 10 --out "$dir"
    ;;
qwen)  # issue 5: tiny checkpoint end to end (n-gram both rollbacks, table, MTP, shortlist); issue 8: trees e2e
    step 260 spec_tiny python scripts/bench_spec.py --model checkpoints/tiny-qwen35-code \
        --prompts build/corpus/prompts.json --num-prompts 8 --max-new-tokens 128 --gammas 1,4,8,16 --repeats 20 \
        --out "$dir"
    step 260 tree_tiny python scripts/bench_tree.py --model checkpoints/tiny-qwen35-code \
        --prompts build/corpus/prompts.json --num-prompts 8 --max-new-tokens 128 --nodes 8,64 --shapes bushy \
        --trees "2,2,2,1;4,2,1" --time-budget-s 200 --out "$dir"
    ;;
ab)  # the tiny model's speculative step piece by piece, then leads for it, each paired with AR in its own run:
    # the plain defaults; verification + commit through the Pallas recurrent / commit kernels (one launch per
    # layer each); whole while loops as CUDA graphs (XLA command buffers with WHILE / CONDITIONAL)
    args=(--model checkpoints/tiny-qwen35-code --skip-steps --prompts build/corpus/prompts.json --num-prompts 6
          --e2e-methods ngram,mtp --out "$dir")
    step 80 spec_step_pieces python scripts/profile_spec_step.py --model checkpoints/tiny-qwen35-code --out "$dir"
    step 150 spec_tiny_plain python scripts/bench_spec.py "${args[@]}" --tag _plain
    SPECDEC_GDN_IMPLEMENTATION=recurrent=pallas,commit=pallas \
        step 150 spec_tiny_pallas_small_t python scripts/bench_spec.py "${args[@]}" --tag _pallas_small_t
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE" \
        step 150 spec_tiny_graphs python scripts/bench_spec.py "${args[@]}" --tag _graphs
    ;;
tune)  # issue 4: the chunk op's stages and launch settings, the products-only triangular inverse (wy_solver=merge)
    step 300 tune_chunk python scripts/tune_gdn_chunk.py --out "$dir"
    ;;
looped)  # issue 6: Huginn-0125 per-round costs, then the das-wave / component grid on the trained checkpoint
    step 200 looped_costs python scripts/bench_looped_spec.py --costs --skip-e2e --time-budget-s 170 --out "$dir"
    step 330 looped_e2e python scripts/bench_looped_spec.py --grid full --methods das-wave,component \
        --num-prompts 8 --time-budget-s 290 --out "$dir"
    ;;
looped-grid)  # issue 6: sequential self-spec / mature-spec grid
    step 560 looped_seq python scripts/bench_looped_spec.py --grid full --methods self-spec,mature-spec \
        --num-prompts 8 --time-budget-s 520 --out "$dir"
    ;;
exact)  # issue 13: bf16 outputs against AR (shipped checkpoints, 9B shape damped), the exact path's AR cost
    step 150 exact_9b python scripts/bench_exact.py --part 9b --num-prompts 2 --ar-rows 4,8 --out "$dir"
    step 190 exact_tiny_qwen python scripts/bench_exact.py --part tiny --models qwen --tag _qwen --out "$dir"
    step 190 exact_tiny_huginn python scripts/bench_exact.py --part tiny --models huginn --tag _huginn --out "$dir"
    ;;
exact-final)  # issue 13: the exact path's cost curve at its row rule, then both shipped checkpoints end to end
    step 200 curve_9b python scripts/bench_spec.py --random-9b --forced-acceptance 0.6,0.8,1.0 --exact on \
        --rollbacks replay --gammas 2,4,8,16 --repeats 3 --max-new-tokens 128 --prompt-len 256 --time-budget-s 185 \
        --tag _exact --out "$dir"
    step 160 exact_tiny_qwen python scripts/bench_exact.py --part tiny --models qwen --tag _qwen --out "$dir"
    step 100 exact_tiny_huginn python scripts/bench_exact.py --part tiny --models huginn --tag _huginn --out "$dir"
    ;;
exact-curve)  # issues 12/13: the 9B forced-acceptance cost curve, exact (default) and fast paths paired
    step 470 curve_9b python scripts/bench_spec.py --random-9b --forced-acceptance 0.6,0.8,1.0 --exact both \
        --rollbacks replay --gammas 2,4,8,16 --repeats 3 --max-new-tokens 128 --prompt-len 256 --time-budget-s 450 \
        --out "$dir"
    step 110 exact_tiny_qwen python scripts/bench_exact.py --part tiny --models qwen --tag _qwen --out "$dir"
    ;;
exact-all)  # issues 13, 17: every chain method (self-drafts included) against AR on the shipped checkpoints:
    # 21 held-out prompts of >= 64 tokens (exact and fast paths), then all 32 cut to their last 16 tokens
    # (exact), Huginn likewise; the 9B shape (damped) at the final row rule
    step 200 exact_qwen python scripts/bench_exact.py --part tiny --models qwen --num-prompts 32 --prompt-len 64 \
        --tag _qwen --out "$dir"
    step 120 exact_qwen_all python scripts/bench_exact.py --part tiny --models qwen --num-prompts 32 --prompt-len 16 \
        --modes exact --tag _qwen_all32 --out "$dir"
    step 90 exact_huginn_all python scripts/bench_exact.py --part tiny --models huginn --num-prompts 32 \
        --prompt-len 16 --modes exact --tag _huginn_all32 --out "$dir"
    step 150 exact_9b python scripts/bench_exact.py --part 9b --num-prompts 2 --ar-rows 8,9 --out "$dir"
    ;;
qwen-all)  # issues 13, 17: the shipped Qwen checkpoint's chain methods (self-drafts included) as in exact-all, then
    # the self-drafts' step cost on the 9B forced-acceptance curve, n-gram (free drafts) paired
    step 170 exact_qwen python scripts/bench_exact.py --part tiny --models qwen --num-prompts 32 --prompt-len 64 \
        --tag _qwen --out "$dir"
    step 110 exact_qwen_all python scripts/bench_exact.py --part tiny --models qwen --num-prompts 32 --prompt-len 16 \
        --modes exact --tag _qwen_all32 --out "$dir"
    step 290 curve_9b python scripts/bench_spec.py --random-9b --forced-acceptance 0.5,0.7,0.85,1.0 --exact on \
        --curve-method ngram,layer-skip,residual-reuse,partial-mlp --rollbacks replay --gammas 2,4 --repeats 2 \
        --max-new-tokens 128 --prompt-len 256 --time-budget-s 275 --tag _selfdraft --out "$dir"
    ;;
selfdraft)  # issue 17: each self-draft's step cost at gamma 2-4 on the 9B forced curve, with and without a token
    # shortlist (a synthetic 32768-token one: only the cost is measured), partial-mlp at mlp_keep 0.75; n-gram paired
    step 440 curve_9b python scripts/bench_spec.py --random-9b --forced-acceptance 0.7,1.0 --exact on \
        --curve-method "ngram,layer-skip,layer-skip:shortlist_size=32768,partial-mlp:mlp_keep=0.75,partial-mlp:mlp_keep=0.75:shortlist_size=32768,residual-reuse,residual-reuse:shortlist_size=32768" \
        --rollbacks replay --gammas 2,3,4 --repeats 2 --max-new-tokens 128 --prompt-len 256 --time-budget-s 425 \
        --tag _selfdraft --out "$dir"
    ;;
profile)  # issues 12, 13: device time kernel by kernel (profiler trace) of AR and speculative steps, 9B and tiny
    step 230 profile_9b python scripts/bench_spec.py --random-9b --forced-acceptance 1.0 --exact on --curve-method ngram \
        --rollbacks replay --gammas 2,8 --repeats 1 --max-new-tokens 64 --prompt-len 256 --kernel-profile \
        --tag _profile --out "$dir"
    step 200 profile_tiny python scripts/bench_spec.py --model checkpoints/tiny-qwen35-code --forced-acceptance 1.0 \
        --exact on --curve-method ngram,mtp --rollbacks replay --gammas 4,8 --repeats 1 --max-new-tokens 64 \
        --prompt-len 64 --kernel-profile --tag _profile --out "$dir"
    ;;
graphs)  # issue 12: whole decode loops as CUDA graphs (XLA command buffers with WHILE / CONDITIONAL: no host
    # round trip per speculative step) against the default flags, each paired with its own AR; tiny, then 9B
    graphs="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"
    tiny=(--model checkpoints/tiny-qwen35-code --forced-acceptance 0.7,1.0 --exact on --curve-method ngram,mtp
          --rollbacks replay --gammas 4,8 --repeats 3 --max-new-tokens 128 --prompt-len 64 --out "$dir")
    step 110 tiny_plain python scripts/bench_spec.py "${tiny[@]}" --tag _plain
    step 110 tiny_graphs env XLA_FLAGS="${XLA_FLAGS:-} $graphs" python scripts/bench_spec.py "${tiny[@]}" --tag _graphs
    step 200 curve_9b_graphs env XLA_FLAGS="${XLA_FLAGS:-} $graphs" python scripts/bench_spec.py --random-9b \
        --forced-acceptance 0.7,1.0 --exact on --rollbacks replay --gammas 2,4,8 --repeats 2 --max-new-tokens 128 \
        --prompt-len 256 --time-budget-s 185 --tag _graphs --out "$dir"
    ;;
replay)  # issues 12, 13: every GDN layer's replay in one launch, no state written by verification, the AR state
    # carried in place: the 9B cost curve (default = exact path), the kernel profile again, bf16 equality with AR
    # on the shipped Qwen (every chain method, exact path) and at the 9B shape (damped)
    step 200 curve_9b python scripts/bench_spec.py --random-9b --forced-acceptance 0.6,0.8,1.0 --exact on \
        --rollbacks replay --gammas 2,4,8,16 --repeats 2 --max-new-tokens 128 --prompt-len 256 --time-budget-s 185 \
        --tag _exact --out "$dir"
    step 85 profile_9b python scripts/bench_spec.py --random-9b --forced-acceptance 1.0 --exact on --curve-method ngram \
        --rollbacks replay --gammas 2,8 --repeats 1 --max-new-tokens 64 --prompt-len 256 --kernel-profile \
        --tag _profile --out "$dir"
    if [ "${REPLAY_EXACT:-1}" = 1 ]; then  # REPLAY_EXACT=0: the timings only
        step 120 exact_qwen python scripts/bench_exact.py --part tiny --models qwen --num-prompts 20 --prompt-len 64 \
            --modes exact --tag _qwen --out "$dir"
        step 110 exact_9b python scripts/bench_exact.py --part 9b --num-prompts 1 --ar-rows 8,9 --repeats 3 --out "$dir"
    fi
    ;;
current)  # issue 13: bf16 equality with AR at the current code: every chain method on the shipped Qwen, every looped
    # method on the shipped Huginn (exact path, the 20 held-out prompts of >= 64 tokens), the 9B shape (damped)
    step 130 exact_qwen python scripts/bench_exact.py --part tiny --models qwen --num-prompts 20 --prompt-len 64 \
        --modes exact --tag _qwen_current --out "$dir"
    step 110 exact_huginn python scripts/bench_exact.py --part tiny --models huginn --num-prompts 20 --prompt-len 64 \
        --modes exact --tag _huginn_current --out "$dir"
    step 120 exact_9b python scripts/bench_exact.py --part 9b --num-prompts 1 --ar-rows 8,9 --repeats 3 \
        --tag _current --out "$dir"
    ;;
live)  # issue 12: the exact path's GDN recurrence on the rows that can be valid (AR 1, verification gamma + 1, not all
    # decode rows): the 9B cost curve with its AR, then AR and steps kernel by kernel (gamma 2, 8, 16)
    step 200 curve_9b python scripts/bench_spec.py --random-9b --forced-acceptance 0.6,0.8,1.0 --exact on \
        --rollbacks replay --gammas 2,4,8,16 --repeats 2 --max-new-tokens 128 --prompt-len 256 --time-budget-s 185 \
        --tag _live --out "$dir"
    step 150 profile_9b python scripts/bench_spec.py --random-9b --forced-acceptance 1.0 --exact on --curve-method ngram \
        --rollbacks replay --gammas 2,8,16 --repeats 1 --max-new-tokens 64 --prompt-len 256 --kernel-profile \
        --tag _live_profile --out "$dir"
    ;;
live-check)  # issues 12, 13: bf16 equality with AR after that change (every Qwen chain method, the 9B shape damped,
    # AR at 8 and 9 rows against 1), then the tiny checkpoint end to end
    step 130 exact_qwen python scripts/bench_exact.py --part tiny --models qwen --num-prompts 20 --prompt-len 64 \
        --modes exact --tag _qwen_live --out "$dir"
    step 120 exact_9b python scripts/bench_exact.py --part 9b --num-prompts 1 --ar-rows 8,9 --repeats 3 \
        --tag _live --out "$dir"
    step 200 e2e_tiny python scripts/bench_spec.py --model checkpoints/tiny-qwen35-code --skip-steps \
        --prompts benchmarks/prompts/heldout_stdlib.json --num-prompts 8 --max-new-tokens 128 \
        --e2e-methods ngram:4,ngram:8,mtp:3,mtp:4,mtp-shortlist:4 --tag _live --out "$dir"
    ;;
preload)  # issue 12: gamma 8 and 16 steps (9B, exact path, full acceptance) with the small-T kernel's inputs preloaded
    # up to 32 rows (the default), 16 and 8: is the 17-row verification (27.6 us per layer against 7.8 at 9) spilling?
    for bound in 32 16 8; do
        SPECDEC_GDN_PRELOAD_MAX=$bound step 100 curve_preload$bound python scripts/bench_spec.py --random-9b \
            --forced-acceptance 1.0 --exact on --rollbacks replay --gammas 8,16 --repeats 2 --max-new-tokens 96 \
            --prompt-len 256 --time-budget-s 90 --tag _preload$bound --out "$dir"
    done
    ;;
rolled)  # issue 12 (not yet run): gamma 8 and 16 steps (9B, exact path, full acceptance) with the small-T kernel's steps
    # unrolled up to 64 rows (the default) or run as a loop from 17 / 9 rows (SPECDEC_GDN_UNROLL_MAX): is the 17-row
    # verification (27.6 us per layer against 7.8 at 9; 382 KB of unrolled code) bound by its code size?
    for bound in 64 16 8; do
        SPECDEC_GDN_UNROLL_MAX=$bound step 100 curve_unroll$bound python scripts/bench_spec.py --random-9b \
            --forced-acceptance 1.0 --exact on --rollbacks replay --gammas 8,16 --repeats 2 --max-new-tokens 96 \
            --prompt-len 256 --time-budget-s 85 --tag _unroll$bound --out "$dir"
    done
    # a loop-form verification must still give AR's (unrolled, one row) output bit for bit: 9B shape damped, gamma 16
    SPECDEC_GDN_UNROLL_MAX=${ROLLED_CHECK:-16} step 110 exact_9b_rolled python scripts/bench_exact.py --part 9b \
        --num-prompts 1 --gamma 16 --ar-rows 17 --repeats 1 --tag _rolled --out "$dir"
    ;;
rolled-curve)  # issues 12, 14: the 9B cost curve at the small-T kernel's new unroll bound (a loop from 17 rows), then the
    # looped forced curve at the Huginn-0125 shape with das-wave's p dense where the trained tiny checkpoint's
    # acceptance lies (13.5 / 14.6 tokens per verification at gamma 16, k 1 / 2), projected at that run's acceptance
    step 200 curve_9b python scripts/bench_spec.py --random-9b --forced-acceptance 0.6,0.8,1.0 --exact on \
        --rollbacks replay --gammas 2,4,8,16 --repeats 2 --max-new-tokens 128 --prompt-len 256 --time-budget-s 185 \
        --tag _rolled --out "$dir"
    step 270 looped_curve python scripts/bench_looped_curve.py --max-new-tokens 48 --repeats 1 --time-budget-s 235 \
        --das-ps 0.5,0.8,0.9,0.95,0.97,0.98,1.0 --ps 0.5,0.8,1.0 \
        --tiny-acceptance benchmarks/results/looped_spec_tiny-huginn-code_r32_20261201_174439.json --out "$dir"
    ;;
rolled-check)  # issues 12, 14 at the current code: DAS-Wave on the tiny checkpoint end to end (8 held-out prompts),
    # Huginn-0125 AR at R = 32 against its roofline, then the 9B steps kernel by kernel (gamma 2, 8, 16)
    step 170 looped_tiny python scripts/bench_looped_spec.py --grid small --methods das-wave --num-prompts 8 \
        --time-budget-s 110 --out "$dir"
    step 90 looped_ar python scripts/bench_looped.py --out "$dir"
    step 150 profile_9b python scripts/bench_spec.py --random-9b --forced-acceptance 1.0 --exact on --curve-method ngram \
        --rollbacks replay --gammas 2,8,16 --repeats 1 --max-new-tokens 64 --prompt-len 256 --kernel-profile \
        --tag _rolled_profile --out "$dir"
    ;;
waits)  # issue 12: where a 9B spec step's device sits idle (0.1 / 0.3 / 0.5 ms per step at gamma 2 / 8 / 16 untraced
    # against none per AR token): the kernels around every wait of >= 10 us, AR and gamma 2 / 8
    step 150 profile_9b python scripts/bench_spec.py --random-9b --forced-acceptance 1.0 --exact on --curve-method ngram \
        --rollbacks replay --gammas 2,8 --repeats 1 --max-new-tokens 64 --prompt-len 256 --kernel-profile \
        --tag _waits --out "$dir"
    ;;
nocb)  # issue 12: the 1.2 ms (traced) wait after each spec step's predicate read, before its first kernel: XLA's
    # command buffers (CUDA graphs of each thunk sequence, updated on the host)? Default flags against none, each
    # paired with its own AR: 9B at p = 1 (gamma 2, 8, 16), then the tiny checkpoint (n-gram, MTP at gamma 4)
    nocb="--xla_gpu_enable_command_buffer="
    big=(--random-9b --forced-acceptance 1.0 --exact on --rollbacks replay --gammas 2,8,16 --repeats 2
         --max-new-tokens 96 --prompt-len 256 --time-budget-s 80 --out "$dir")
    tiny=(--model checkpoints/tiny-qwen35-code --forced-acceptance 1.0 --exact on --curve-method ngram,mtp
          --rollbacks replay --gammas 4 --repeats 3 --max-new-tokens 128 --prompt-len 64 --out "$dir")
    step 95 curve_9b_cb python scripts/bench_spec.py "${big[@]}" --tag _cb
    step 95 curve_9b_nocb env XLA_FLAGS="${XLA_FLAGS:-} $nocb" python scripts/bench_spec.py "${big[@]}" --tag _nocb
    step 70 tiny_cb python scripts/bench_spec.py "${tiny[@]}" --tag _cb
    step 70 tiny_nocb env XLA_FLAGS="${XLA_FLAGS:-} $nocb" python scripts/bench_spec.py "${tiny[@]}" --tag _nocb
    ;;
replay-kept)  # issue 12 (next): the replay running only the steps it keeps (SPECDEC_GDN_REPLAY_SKIP=1, off by default):
    # bf16 equality with AR at the 9B shape (forced drafts: partial acceptance; its first run hit the 100 s limit), then
    # gamma 8 / 16 at p 0.6, 1 with the knob off and on, each paired with its own AR
    SPECDEC_GDN_REPLAY_SKIP=1 step 160 exact_9b python scripts/bench_exact.py --part 9b --num-prompts 1 --ar-rows 9 \
        --repeats 1 --tag _replay_kept --out "$dir"
    for skip in 0 1; do
        SPECDEC_GDN_REPLAY_SKIP=$skip step 90 curve_9b_skip$skip python scripts/bench_spec.py --random-9b \
            --forced-acceptance 0.6,1.0 --exact on --rollbacks replay --gammas 8,16 --repeats 2 --max-new-tokens 96 \
            --prompt-len 256 --time-budget-s 80 --tag _replay_skip$skip --out "$dir"
    done
    ;;
loop-forms)  # issue 12: the spec step's host gap (0.1 / 0.3 ms per step at gamma 2 / 8 untraced, none per AR token):
    # the same jitted step in lax.while_loop, dispatched from Python without reads, and with a read per step, each
    # paired with AR; then each form traced, with what the host did while the device waited
    step 330 loop_forms_9b python scripts/bench_loop_forms.py --random-9b --gammas 2,8 --new-tokens 96 --repeats 3 \
        --kernel-profile --out "$dir"
    ;;
loop-forms-tiny)  # issue 12: the same on the tiny checkpoint, where a step's device time (~0.24 ms) is near the host's
    step 200 loop_forms_tiny python scripts/bench_loop_forms.py --model checkpoints/tiny-qwen35-code --methods ngram,mtp \
        --gammas 3,4,8 --prompt-len 64 --new-tokens 128 --repeats 5 --out "$dir"
    ;;
stacked)  # issue 12: every GDN state in one array; the step kernels read and write their layer in place and the commit
    # replays all layers in one launch: the 9B steps kernel by kernel (gamma 2, 8, 16), then the 9B cost curve
    step 150 profile_9b python scripts/bench_spec.py --random-9b --forced-acceptance 1.0 --exact on --curve-method ngram \
        --rollbacks replay --gammas 2,8,16 --repeats 1 --max-new-tokens 64 --prompt-len 256 --kernel-profile \
        --tag _stacked_profile --out "$dir"
    step 210 curve_9b python scripts/bench_spec.py --random-9b --forced-acceptance 0.6,0.8,1.0 --exact on \
        --rollbacks replay --gammas 2,4,8,16 --repeats 2 --max-new-tokens 128 --prompt-len 256 --time-budget-s 195 \
        --tag _stacked --out "$dir"
    ;;
convstack)  # issue 12: every GDN conv state in one array too (the commit takes every layer's window in one op): the
    # 9B steps kernel by kernel with the optimized HLO of the step kept (what each small fusion is), the 9B cost
    # curve, bf16 equality at the 9B shape (gamma 16, damped) and on the shipped Qwen (every chain method)
    XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$dir/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*(spec_loop|decode_loop).*" \
        step 150 profile_9b python scripts/bench_spec.py --random-9b --forced-acceptance 1.0 --exact on \
        --curve-method ngram --rollbacks replay --gammas 2,8,16 --repeats 1 --max-new-tokens 64 --prompt-len 256 \
        --kernel-profile --tag _convstack_profile --out "$dir"
    find "$dir/hlo" -type f ! -name '*after_optimizations.txt' -delete 2>/dev/null
    step 200 curve_9b python scripts/bench_spec.py --random-9b --forced-acceptance 0.6,0.8,1.0 --exact on \
        --rollbacks replay --gammas 2,4,8,16 --repeats 2 --max-new-tokens 128 --prompt-len 256 --time-budget-s 180 \
        --tag _convstack --out "$dir"
    step 100 exact_9b_g16 python scripts/bench_exact.py --part 9b --num-prompts 1 --gamma 16 --ar-rows 17 --repeats 1 \
        --tag _convstack_g16 --out "$dir"
    step 120 exact_qwen python scripts/bench_exact.py --part tiny --models qwen --num-prompts 20 --prompt-len 64 \
        --modes exact --tag _qwen_convstack --out "$dir"
    ;;
fixedcost)  # issue 12: what a decode call costs beyond its steps (bench_fixed_cost.py: AR and the n-gram loop at
    # gamma 8, p 1, timed at 24..192 new tokens, a line fitted): 9B with the state donated and not, 9B with XLA's
    # command buffers off, the tiny checkpoint; then the tiny checkpoint end to end at the current code
    step 170 fixed_9b python scripts/bench_fixed_cost.py --random-9b --gamma 8 --tokens 24,48,96,192 --repeats 3 \
        --donate on,off --out "$dir"
    step 120 fixed_9b_nocb env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" python \
        scripts/bench_fixed_cost.py --random-9b --gamma 8 --tokens 24,48,96,192 --repeats 3 --tag _nocb --out "$dir"
    step 80 fixed_tiny python scripts/bench_fixed_cost.py --model checkpoints/tiny-qwen35-code --prompt-len 64 \
        --gamma 8 --tokens 24,48,96,192 --repeats 5 --out "$dir"
    step 190 e2e_tiny python scripts/bench_spec.py --model checkpoints/tiny-qwen35-code --skip-steps \
        --prompts benchmarks/prompts/heldout_stdlib.json --num-prompts 8 --max-new-tokens 128 \
        --e2e-methods ngram:4,ngram:8,mtp:3,mtp:4 --tag _convstack --out "$dir"
    ;;
cbmodes2)  # issue 12 (not yet run): launch settings of this jaxlib on top of the concurrent schedule (the default),
    # each compiled beside the default and timed alternately in one process: programmatic dependent launch (a kernel's
    # start overlapping its predecessor's tail: a 9B step is ~600 launches, a tiny one ~150), its launch flag alone,
    # and concurrent regions in the command buffers
    for model_args in "--random-9b" "--model checkpoints/tiny-qwen35-code --prompt-len 64"; do
        name=$([ "$model_args" = "--random-9b" ] && echo 9b || echo tiny)
        step 260 "pdl_$name" python scripts/bench_fixed_cost.py $model_args --gamma 8 --tokens 24,192 --repeats 3 \
            --loop-option "xla_gpu_enable_pdl=True;xla_gpu_enable_pdl_launch=True" \
            --loop-option "xla_gpu_enable_pdl_launch=True" \
            --loop-option "xla_gpu_graph_enable_concurrent_region=True" --tag _cbmodes2 --out "$dir"
    done
    ;;
tune-replay)  # issue 12 (not yet run): the commit's all-layer replay (85 / 99 us per 9B step at gamma 8 / 16) runs
    # block_v 8 with 1 warp, the decode kernel's setting, for the same bits. Other block / warp settings of the
    # recurrent kernel and its replay at T = 9 and 17, each checked bit for bit against the decode kernel's states, and
    # the replay of 24 layers in one launch timed: a replay may move to a faster setting whose states are equal
    step 330 tune python scripts/tune_recurrent.py --lengths 9,17 --preloads True --block-vs 8,16,32 \
        --num-warps 1,2,4 --stack 24 --chain 24 --repeats 5 --out "$dir"
    ;;
concurrent)  # issue 12: Qwen programs now compile with command buffers scheduled CONCURRENT (compiled.compiler_options,
    # chosen by cbmodes): the 9B cost curve (AR compiled the same way, same run), tiny end to end, bf16 equality
    step 190 curve_9b python scripts/bench_spec.py --random-9b --forced-acceptance 0.8,1.0 --exact on \
        --rollbacks replay --gammas 2,4,8,16 --repeats 2 --max-new-tokens 128 --prompt-len 256 --time-budget-s 150 \
        --tag _concurrent --out "$dir"
    step 100 e2e_tiny python scripts/bench_spec.py --model checkpoints/tiny-qwen35-code --skip-steps \
        --prompts benchmarks/prompts/heldout_stdlib.json --num-prompts 8 --max-new-tokens 128 \
        --e2e-methods ngram:8,mtp:3 --tag _concurrent --out "$dir"
    step 80 exact_qwen python scripts/bench_exact.py --part tiny --models qwen --num-prompts 8 --prompt-len 64 \
        --modes exact --tag _qwen_concurrent --out "$dir"
    ;;
cbmodes)  # issue 12: XLA command-buffer settings for both loops, each timed beside the default in one process (fixed
    # and per-step cost): update mode SKIP_TEMP (this jaxlib's modes: ALWAYS_UPDATE, SKIP_TEMP, SKIP_PROFILED) and
    # scheduling mode CONCURRENT
    step 240 modes_9b python scripts/bench_fixed_cost.py --random-9b --gamma 8 --tokens 24,192 --repeats 3 \
        --loop-option xla_gpu_command_buffer_update_mode=SKIP_TEMP \
        --loop-option xla_gpu_command_buffer_scheduling_mode=CONCURRENT --tag _cbmodes --out "$dir"
    step 90 modes_tiny python scripts/bench_fixed_cost.py --model checkpoints/tiny-qwen35-code --prompt-len 64 \
        --gamma 8 --tokens 24,192 --repeats 3 --loop-option xla_gpu_command_buffer_update_mode=SKIP_TEMP \
        --loop-option xla_gpu_command_buffer_scheduling_mode=CONCURRENT --tag _cbmodes --out "$dir"
    ;;
cbwhile)  # issue 12: the spec loop has no known trip count (cmdbuf: fixed_cost_qwen35_9b_random_hlo.md), so XLA drives
    # it from the host, step by step; AR's has one. Both loops compiled also with XLA's WHILE and CONDITIONAL
    # command-buffer types added to its defaults (a loop on the device, CUDA conditional nodes), timed beside the
    # default in one process: tiny and 9B, fixed and per-step cost
    local_opt=xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL
    step 120 cb_tiny python scripts/bench_fixed_cost.py --model checkpoints/tiny-qwen35-code --prompt-len 64 \
        --gamma 8 --tokens 24,48,96,192 --repeats 3 --loop-option "$local_opt" --tag _cbwhile --out "$dir"
    step 330 cb_9b python scripts/bench_fixed_cost.py --random-9b --gamma 8 --tokens 24,96,192 --repeats 2 \
        --loop-option "$local_opt" --tag _cbwhile --out "$dir"
    ;;
cmdbuf)  # issue 12: the traced spec loop runs host-driven (a predicate read back and the body launched every step,
    # fixed_cost_qwen35_9b_random_trace.md), AR's not: each loop's while loops, trip counts and what their bodies
    # launch (--hlo; the optimized HLO shows no command buffers: AR's loop has a known trip count, the spec loop
    # none), with XLA's default command-buffer types and with dynamic-slice fusions added (DYNAMIC_SLICE_COPY_FUSION
    # is no type in this XLA: that step fails at once), tiny timed, 9B compiled only
    step 90 hlo_tiny python scripts/bench_fixed_cost.py --model checkpoints/tiny-qwen35-code --prompt-len 64 \
        --gamma 8 --tokens 24,96 --repeats 3 --hlo --tag _hlo --out "$dir"
    for extra in DYNAMIC_SLICE_FUSION DYNAMIC_SLICE_COPY_FUSION; do
        XLA_FLAGS="--xla_gpu_enable_command_buffer=+$extra" step 90 "hlo_tiny_$extra" python scripts/bench_fixed_cost.py \
            --model checkpoints/tiny-qwen35-code --prompt-len 64 --gamma 8 --tokens 24,96 --repeats 3 --hlo \
            --tag "_hlo_$extra" --out "$dir"
    done
    step 150 hlo_9b python scripts/bench_fixed_cost.py --random-9b --gamma 8 --tokens 24,96 --hlo --hlo-only \
        --tag _hlo --out "$dir"
    ;;
fixedcost-trace)  # issue 12 (not yet run): where a call's fixed cost goes (AR ~1.4 ms, speculation ~3.0 ms per 9B call,
    # fixed_cost_qwen35_9b_random.md): one traced call of each loop, what the host did before the first kernel and
    # after the last (profiling.call_edges), 9B and tiny
    step 150 trace_9b python scripts/bench_fixed_cost.py --random-9b --gamma 8 --tokens 24,96 --repeats 2 --trace \
        --tag _trace --out "$dir"
    step 60 trace_tiny python scripts/bench_fixed_cost.py --model checkpoints/tiny-qwen35-code --prompt-len 64 \
        --gamma 8 --tokens 24,96 --repeats 3 --trace --tag _trace --out "$dir"
    ;;
stacked-check)  # issues 12, 13 after that change: bf16 equality with AR (every Qwen chain method on the shipped
    # checkpoint, the 9B shape damped at gamma 16), the all-layer replay without its inputs preloaded (fewer registers,
    # more programs in flight: 72 against 96 / 167 at 3 / 9 rows), then the tiny checkpoint end to end
    step 130 exact_qwen python scripts/bench_exact.py --part tiny --models qwen --num-prompts 20 --prompt-len 64 \
        --modes exact --tag _qwen_stacked --out "$dir"
    SPECDEC_GDN_REPLAY_PRELOAD_MAX=1 step 110 profile_9b_nopreload python scripts/bench_spec.py --random-9b \
        --forced-acceptance 1.0 --exact on --curve-method ngram --rollbacks replay --gammas 2,8,16 --repeats 2 \
        --max-new-tokens 64 --prompt-len 256 --kernel-profile --tag _stacked_replay_nopreload --out "$dir"
    step 110 exact_9b_g16 python scripts/bench_exact.py --part 9b --num-prompts 1 --gamma 16 --ar-rows 17 --repeats 1 \
        --tag _stacked_g16 --out "$dir"
    step 200 e2e_tiny python scripts/bench_spec.py --model checkpoints/tiny-qwen35-code --skip-steps \
        --prompts benchmarks/prompts/heldout_stdlib.json --num-prompts 8 --max-new-tokens 128 \
        --e2e-methods ngram:4,ngram:8,mtp:3,mtp:4 --tag _stacked --out "$dir"
    ;;
reuse)  # issue 17: residual-reuse after its deltas moved out of the verifier: equality on all 32 prompts, speed
    step 80 exact_reuse_all python scripts/bench_exact.py --part tiny --models qwen --methods residual-reuse \
        --num-prompts 32 --prompt-len 16 --modes exact --tag _reuse_all32 --out "$dir"
    step 80 exact_reuse python scripts/bench_exact.py --part tiny --models qwen --methods residual-reuse,layer-skip \
        --num-prompts 32 --prompt-len 64 --modes exact --tag _reuse --out "$dir"
    ;;
looped-scale)  # issue 14: the looped methods' forced cost curve at the Huginn-0125 shape, Huginn-0125 AR at R = 32
    # twice more (noise or regression), then the per-round costs
    step 210 looped_curve python scripts/bench_looped_curve.py --max-new-tokens 48 --repeats 1 --time-budget-s 180 \
        --tiny-acceptance benchmarks/results/looped_spec_tiny-huginn-code_r32_20261130_092157.json --out "$dir"
    for i in 1 2; do
        step 80 looped_ar_$i python scripts/bench_looped.py --out "$dir"
    done
    step 200 looped_costs python scripts/bench_looped_spec.py --costs --skip-e2e --time-budget-s 180 --out "$dir"
    ;;
train)  # issue 15: the corpus from this machine's Python and site-packages, then the tiny checkpoints retrained on it
    # at the same time (three processes share the GPU: Qwen + MTP, and Huginn with two recurrence recipes, the
    # better one to ship), then the Qwen draft tables; the checkpoints come back as tar parts of <= 15 MiB.
    # Smoke on CPU: CORPUS_ARGS="--max-train-chars 3e6 --tokenizer-chars 1e6" TRAIN_ARGS="--batch 2 --seq-len 64
    #   --hidden 64 --intermediate 128" TABLE_ARGS="--prompts 4 --batch 4 --new-tokens 8" TRAIN_END_S=60
    step 260 corpus python scripts/build_corpus.py --out build/corpus ${CORPUS_ARGS:-}
    budget=$(( ${TRAIN_END_S:-400} - SECONDS ))
    (( budget < 60 )) && budget=60
    echo "training budget ${budget} s per run" | tee -a "$dir/suite.log"
    common=(--corpus build/corpus --batch 128 --seq-len 512 --lr 3e-3 --steps 200000 --time-budget-s "$budget"
            --eval-every 400 --eval-max-tokens 262144 --keep-best --log-every 100 ${TRAIN_ARGS:-})
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.3
    limit=$(( 555 - SECONDS ))
    step "$limit" train_qwen python scripts/train_tiny.py --arch qwen35 --mtp-distill 0.5 \
        --out "$dir/ck/tiny-qwen35-code" "${common[@]}" &
    step "$limit" train_huginn_m32 python scripts/train_tiny.py --arch huginn --mean-recurrence 32 --backprop-depth 8 \
        --out "$dir/ck/tiny-huginn-code-m32" "${common[@]}" &
    step "$limit" train_huginn_m16 python scripts/train_tiny.py --arch huginn --mean-recurrence 16 --backprop-depth 8 \
        --out "$dir/ck/tiny-huginn-code-m16" "${common[@]}" &
    wait
    unset XLA_PYTHON_CLIENT_MEM_FRACTION
    step 60 draft_tables python scripts/build_draft_tables.py --model "$dir/ck/tiny-qwen35-code" --corpus build/corpus \
        ${TABLE_ARGS:-}
    cp build/corpus/manifest.json build/corpus/prompts.json build/corpus/LICENSES.md "$dir/"
    tar czf "$out/ck.tgz" -C "$dir" ck && split -b 15m -d "$out/ck.tgz" "$out/ck.tgz.part" && rm "$out/ck.tgz" \
        && rm -rf "$dir/ck"
    ls -la "$out" | tee -a "$dir/suite.log"
    ;;
train-huginn)  # issue 15: two Huginn layouts at the same time on the corpus rebuilt with the Qwen checkpoint's
    # tokenizer: 2+2+2 layers (recurrence mean 16, backprop 8) and 1+4+1 (more of the work inside the loop), both
    # with the wider MLP; the checkpoints come back as tar parts of <= 15 MiB
    huginn_layouts "${TRAIN_END_S:-440}" 580 train_huginn tiny-huginn-code
    cp build/corpus/manifest.json "$dir/"
    tar czf "$out/ck.tgz" -C "$dir" ck && split -b 15m -d "$out/ck.tgz" "$out/ck.tgz.part" && rm "$out/ck.tgz" \
        && rm -rf "$dir/ck"
    ;;
train-depth)  # issue 15: does depth matter more when the recurrence is trained from the official random initial state
    # (as Huginn-0125 was) instead of zeros? The same two layouts, both with --init-state-scale 1, trained side by
    # side; held-out loss at r = 1..32 (train logs only, no checkpoints)
    huginn_layouts "${TRAIN_END_S:-420}" 540 train_random_init random-init --init-state-scale 1
    for run in 222 141; do cp "$dir/ck/random-init-$run/train_log.json" "$dir/train_log_random_init_$run.json"; done
    rm -rf "$dir/ck"
    ;;
train-depth-floor)  # issue 15: does depth matter when training never samples a shallow recurrence? The 2+2+2 and
    # 1+4+1 layouts side by side, every sampled recurrence raised to at least 8 (--min-recurrence 8; the official
    # draw otherwise); held-out loss at r = 1..32; the checkpoints come back as tar parts of <= 15 MiB
    huginn_layouts "${TRAIN_END_S:-420}" 540 train_floor8 floor8 --min-recurrence 8
    for run in 222 141; do cp "$dir/ck/floor8-$run/train_log.json" "$dir/train_log_floor8_$run.json"; done
    cp build/corpus/manifest.json "$dir/"
    tar czf "$out/ck.tgz" -C "$dir" ck && split -b 15m -d "$out/ck.tgz" "$out/ck.tgz.part" && rm "$out/ck.tgz" \
        && rm -rf "$dir/ck"
    ;;
retrained)  # issue 15 (and 12, 13, 14): the retrained checkpoints: every chain method of tiny Qwen against AR (equality,
    # speed, exact and fast paths), the looped methods of tiny Huginn likewise, then das-wave end to end
    step 200 exact_qwen python scripts/bench_exact.py --part tiny --models qwen --num-prompts 32 --prompt-len 64 \
        --tag _qwen --out "$dir"
    step 150 exact_huginn python scripts/bench_exact.py --part tiny --models huginn --num-prompts 32 --prompt-len 64 \
        --tag _huginn --out "$dir"
    step 140 looped_dw python scripts/bench_looped_spec.py --grid small --methods das-wave --num-prompts 8 \
        --time-budget-s 115 --out "$dir"
    ;;
mtp-blocks)  # issue 12: the MTP head's few-row forwards as decode-block kernels (pallas_kernels/decode_block, seven
    # launches) against XLA's (~30): the head alone (bench_mtp_head.py) under several warps-per-program settings, then
    # with the fastest of them the tiny checkpoint end to end with both forms and one MTP step kernel by kernel
    step 200 mtp_head python scripts/bench_mtp_head.py --forms "${FORMS:-w8,4/s1/g0:w4,4/s1/g0:w8,8/s1/g0:w4,8/s1/g0}" \
        --out "$dir"
    best=$(python -c "import json,collections as c; r=json.load(open('$dir/mtp_head_tiny-qwen35-code.json'))['rows']
t=c.defaultdict(float)
for x in r: t[x['form']]+=x['us_per_forward'] if x['form']!='xla' else 0
print(min((v,k) for k,v in t.items() if k!='xla')[1].split('/')[0][1:])")
    echo "fastest warps: $best" | tee -a "$dir/suite.log"
    export SPECDEC_DECODE_BLOCK_WARPS=$best
    step 200 e2e_tiny python scripts/bench_spec.py --model checkpoints/tiny-qwen35-code --skip-steps \
        --prompts benchmarks/prompts/heldout_stdlib.json --num-prompts 8 --max-new-tokens 128 \
        --e2e-methods "mtp:3:kernels='xla',mtp:3:kernels='blocks',mtp:4:kernels='xla',mtp:4:kernels='blocks'" \
        --tag _mtp_blocks --out "$dir"
    step 130 profile python scripts/bench_spec.py --model checkpoints/tiny-qwen35-code --forced-acceptance 1.0 \
        --exact on --curve-method "mtp:kernels='xla',mtp:kernels='blocks'" --rollbacks replay --gammas 3 --repeats 1 \
        --max-new-tokens 64 --prompt-len 64 --kernel-profile --tag _mtp_blocks_profile --out "$dir"
    ;;
mtp-final)  # issue 12: the tiny checkpoint end to end at the current defaults (MTP drafting through the decode blocks,
    # their warps chosen in mtp-blocks), XLA's MTP forward beside them
    step 200 e2e_tiny python scripts/bench_spec.py --model checkpoints/tiny-qwen35-code --skip-steps \
        --prompts benchmarks/prompts/heldout_stdlib.json --num-prompts 8 --max-new-tokens 128 \
        --e2e-methods "ngram:4,ngram:8,mtp:3,mtp:4,mtp:3:kernels='xla',mtp-shortlist:4" --tag _mtp_final --out "$dir"
    ;;
mtp-splits)  # issue 12: the MTP head's attention split over its cache (combined by the output projection) and its fc
    # input gathered by the product (no XLA pad before it): the head alone at two cache fills under each form, then the
    # tiny checkpoint end to end with the fastest form and with the previous one (s1/g0), each in its own process
    # beside its own AR; one step kernel by kernel with the fastest
    step 240 mtp_head python scripts/bench_mtp_head.py --cache-fill 200,1000 --rows 1,4 \
        --forms "${FORMS:-w8,4/s1/g0:w8,4/s1/g1:w8,4/s2/g1:w8,4/s4/g1:w8,4/s8/g1:w8,4/s4/g0}" --out "$dir"
    best=$(python -c "import json,collections as c; r=json.load(open('$dir/mtp_head_tiny-qwen35-code.json'))['rows']
t=c.defaultdict(float)
for x in r: t[x['form']]+=x['us_per_forward'] if x['fill']==200 else 0
print(min((v,k) for k,v in t.items() if k!='xla')[1])")
    echo "fastest form at fill 200: $best" | tee -a "$dir/suite.log"
    splits=$(echo "$best" | sed 's|.*/s\([0-9]*\)/g\([01]\)|\1|'); gather=${best##*/g}
    e2e=(--model checkpoints/tiny-qwen35-code --skip-steps --prompts benchmarks/prompts/heldout_stdlib.json
         --num-prompts 8 --max-new-tokens 128)
    SPECDEC_DECODE_BLOCK_SPLITS=$splits SPECDEC_DECODE_BLOCK_GATHER=$gather step 200 e2e_best \
        python scripts/bench_spec.py "${e2e[@]}" --e2e-methods "mtp:3,mtp:4,ngram:4" --tag _mtp_splits --out "$dir"
    SPECDEC_DECODE_BLOCK_SPLITS=1 SPECDEC_DECODE_BLOCK_GATHER=0 step 150 e2e_before \
        python scripts/bench_spec.py "${e2e[@]}" --e2e-methods "mtp:3,mtp:4" --tag _mtp_splits_before --out "$dir"
    ;;
mtp-gather)  # issue 12: the fc input gathered by its product (default), attention splits against cache fills up to
    # 3000 (which split count from which cache length), the tiny checkpoint end to end at the defaults (3 rounds per
    # prompt), and with 1024-token prompts under 2 splits and under 1
    step 200 mtp_head python scripts/bench_mtp_head.py --cache-fill 200,400,1000,3000 --rows 1 \
        --forms "${FORMS:-w8,4/s1/g1:w8,4/s2/g1:w8,4/s4/g1:w8,4/s1/g1/b128:w8,4/s1/g1/b256:w8,4/s2/g1/b128}" --out "$dir"
    e2e=(--model checkpoints/tiny-qwen35-code --skip-steps --prompts benchmarks/prompts/heldout_stdlib.json
         --max-new-tokens 128)
    step 200 e2e_default python scripts/bench_spec.py "${e2e[@]}" --num-prompts 8 \
        --e2e-methods "ngram:4,ngram:8,mtp:3,mtp:4,mtp-shortlist:4" --tag _mtp_gather --out "$dir"
    for s in 2 1; do
        SPECDEC_DECODE_BLOCK_SPLITS=$s step 120 e2e_long_s$s python scripts/bench_spec.py --model \
            checkpoints/tiny-qwen35-code --skip-steps --prompts heldout-files --max-new-tokens 128 --num-prompts 4 \
            --prompt-len 1024 --e2e-methods "mtp:3" --tag _mtp_long_s$s --out "$dir"
    done
    ;;
mtp-defaults)  # issue 12: the tiny checkpoint end to end at the defaults chosen in mtp-splits / mtp-gather (3 rounds
    # per prompt), XLA's MTP forward beside them; 1024-token prompts, where auto keeps XLA's forward, beside the blocks
    tiny_e2e_short_long 240 150 _mtp_defaults _mtp_defaults_long \
        "ngram:4,ngram:8,mtp:3,mtp:4,mtp:3:kernels='xla',mtp-shortlist:4" "mtp:3,mtp:3:kernels='blocks'"
    ;;
mtp-fuse)  # issue 12: the attention projecting each head's output (summed by the SwiGLU product: one launch fewer
    # per forward) against the output projection as a product of its own: the head alone, then end to end, each form in
    # its own process beside its own AR
    step 200 mtp_head python scripts/bench_mtp_head.py --cache-fill 200,1000 --rows 1,4 \
        --forms "w8,4/s1/g1:w8,4/s1/g1/f1:w8,4/s1/g1/b128/f1:w8,4/s1/g1/b128" --out "$dir"
    e2e=(--model checkpoints/tiny-qwen35-code --skip-steps --max-new-tokens 128
         --prompts benchmarks/prompts/heldout_stdlib.json --num-prompts 8 --e2e-methods "mtp:3,mtp:4")
    for f in 1 0; do
        SPECDEC_DECODE_BLOCK_FUSE_OUT_PROJ=$f step 150 e2e_f$f python scripts/bench_spec.py "${e2e[@]}" \
            --tag _mtp_fuse$f --out "$dir"
    done
    ;;
mtp-chain)  # issues 12 and 15: the corpus (the shipped tokenizer), then side by side on the GPU: the shipped MTP head
    # fine-tuned for chained drafting with the model fixed (train_mtp_head.py, depth 4), and two Huginn layouts with less
    # depth per core application (1+1+1 with a wider MLP, 1+2+1), whose held-out loss should fall further with r.
    # The checkpoints come back as tar parts of <= 15 MiB.
    step 200 corpus python scripts/build_corpus.py --out build/corpus --tokenizer checkpoints/tiny-qwen35-code \
        ${CORPUS_ARGS:-}
    end=${TRAIN_END_S:-470}
    budget=$(( end - SECONDS - 60 ))
    (( budget < 30 )) && budget=30
    echo "training budget ${budget} s per run" | tee -a "$dir/suite.log"
    limit=$(( ${LIMIT_END_S:-565} - SECONDS ))
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.3
    step "$limit" train_head python scripts/train_mtp_head.py --model checkpoints/tiny-qwen35-code --corpus build/corpus \
        --out "$dir/ck/tiny-qwen35-code" --depth 4 --time-budget-s $(( budget - 60 )) --eval-every 300 ${HEAD_ARGS:-} &
    common=(--arch huginn --corpus build/corpus --batch 128 --seq-len 512 --lr 3e-3 --steps 200000
            --time-budget-s "$budget" --eval-every 400 --eval-max-tokens 262144 --keep-best --log-every 100
            --mean-recurrence 16 --backprop-depth 8 ${TRAIN_ARGS:-})
    step "$limit" train_huginn_111 python scripts/train_tiny.py --prelude 1 --core 1 --coda 1 --intermediate 2048 \
        --out "$dir/ck/tiny-huginn-code-111" "${common[@]}" &
    step "$limit" train_huginn_121 python scripts/train_tiny.py --prelude 1 --core 2 --coda 1 --intermediate 1024 \
        --out "$dir/ck/tiny-huginn-code-121" "${common[@]}" &
    wait
    unset XLA_PYTHON_CLIENT_MEM_FRACTION
    for run in 111 121; do
        cp "$dir/ck/tiny-huginn-code-$run/train_log.json" "$dir/train_log_huginn_$run.json" 2>/dev/null
    done
    cp "$dir/ck/tiny-qwen35-code/mtp_head_log.json" "$dir/" 2>/dev/null
    cp build/corpus/manifest.json "$dir/"
    tar czf "$out/ck.tgz" -C "$dir" ck && split -b 15m -d "$out/ck.tgz" "$out/ck.tgz.part" && rm "$out/ck.tgz" \
        && rm -rf "$dir/ck"
    ls -la "$out" | tee -a "$dir/suite.log"
    ;;
mtp-chain-check)  # issue 12: the chain-trained MTP head at the defaults (MTP gamma 4): bf16 equality of every chain
    # method with AR, end to end beside n-gram, gamma 3 and XLA's head forward, and 1024-token prompts (auto / blocks)
    step 120 exact_qwen python scripts/bench_exact.py --part tiny --models qwen --num-prompts 8 --prompt-len 64 \
        --modes exact --tag _qwen_chain_head --out "$dir"
    tiny_e2e_short_long 200 130 _mtp_chain_defaults _mtp_chain_long \
        "ngram:4,ngram:8,mtp:4,mtp:3,mtp:4:kernels='xla',mtp-shortlist:4" "mtp:4,mtp:4:kernels='blocks'"
    ;;
compile)  # issue 12: what one generate() call compiles for, per method at its defaults (caches cleared before each),
    # beside the decode speed it then runs at: tiny Qwen, tiny Huginn, and the 9B shape as far as time allows
    step 150 compile_qwen python scripts/bench_compile.py --model checkpoints/tiny-qwen35-code --time-budget-s 110 \
        --out "$dir"
    step 80 compile_huginn python scripts/bench_compile.py --model checkpoints/tiny-huginn-code --time-budget-s 50 \
        --out "$dir"
    step $(( ${COMPILE_END_S:-330} - SECONDS )) compile_9b python scripts/bench_compile.py --random-9b \
        --methods ar,ngram,layer-skip --time-budget-s 100 --out "$dir"
    ;;
pseudo-replay)  # issue 12: the commit replays each layer from the pseudo-values its verification computed (no reduction
    # in the chain): bit by bit against the full replay and AR at the 9B shape, the 9B steps kernel by kernel, the curve
    step 200 stash_bits python scripts/check_stash_bits.py --steps 48 --ar-steps 32 --out "$dir"
    step 150 profile_9b python scripts/bench_spec.py --random-9b --forced-acceptance 1.0 --exact on --curve-method ngram \
        --rollbacks replay --gammas 2,8,16 --repeats 1 --max-new-tokens 64 --prompt-len 256 --kernel-profile \
        --tag _pseudo_replay_profile --out "$dir"
    step $(( ${CURVE_END_S:-560} - SECONDS )) curve_9b python scripts/bench_spec.py --random-9b --forced-acceptance 0.8,1.0 \
        --exact on --rollbacks replay --gammas 2,4,8,16 --repeats 2 --max-new-tokens 128 --prompt-len 256 \
        --time-budget-s 150 --tag _pseudo_replay --out "$dir"
    ;;
pseudo-replay-tune)  # issue 12: the pseudo-value replay's block and warps (free: elementwise), each checked bit for bit
    # against the verification's own states; the stash bit by bit at the 9B shape; the 9B curve with the fastest
    step 200 tune python scripts/tune_pseudo_replay.py --out "$dir"
    best=$(python -c "import json,sys; r=[x for x in json.load(open(sys.argv[1]))['rows'] if x['equal'] and x['T']==9]; \
b=min(r,key=lambda x:x['us']); print(f\"{b['block_v']}:{b['num_warps']}\")" "$dir/tune_pseudo_replay.json")
    echo "fastest at T = 9 with equal states: $best" | tee -a "$dir/suite.log"
    SPECDEC_GDN_PSEUDO_REPLAY=$best step 90 stash_bits python scripts/check_stash_bits.py --steps 32 --ar-steps 16 \
        --out "$dir"
    SPECDEC_GDN_PSEUDO_REPLAY=$best step $(( ${CURVE_END_S:-570} - SECONDS )) curve_9b python scripts/bench_spec.py \
        --random-9b --forced-acceptance 0.8,1.0 --exact on --rollbacks replay --gammas 2,4,8,16 --repeats 2 \
        --max-new-tokens 128 --prompt-len 256 --time-budget-s 150 --tag _pseudo_replay_tuned --out "$dir"
    ;;
head)  # issue 12: the 9B cost curve at the current code (the forced acceptance's p now on the device before the clock,
    # not measured before), 3 repeats, with AR as real checkpoints run it (an EOS id configured) timed beside; then a
    # call's fixed cost and its step cost fitted over 32..256 new tokens
    step 230 curve_9b python scripts/bench_spec.py --random-9b --forced-acceptance 0.8,1.0 --exact on \
        --rollbacks replay --gammas 2,4,8,16 --repeats 3 --max-new-tokens 128 --prompt-len 256 --time-budget-s 210 \
        --ar-eos 248319 --tag _head --out "$dir"
    step 170 fixed_9b python scripts/bench_fixed_cost.py --random-9b --gamma 8 --tokens 32,64,128,256 --repeats 3 \
        --tag _head --out "$dir"
    ;;
defer)  # issue 12: the loop carrying each step's GDN commit (the all-layer replay, ~69 us per 9B step) into the next
    # step, where the drafting and the first layer's projections need not wait for it (SPECDEC_DEFER_COMMIT): the 9B
    # cost curve with it off and on, each in its own process paired with its own AR; then bf16 equality with AR of every
    # Qwen chain method on the shipped checkpoint with it on
    for d in 0 1; do
        SPECDEC_DEFER_COMMIT=$d step 150 "curve_9b_defer$d" python scripts/bench_spec.py --random-9b \
            --forced-acceptance 0.8,1.0 --exact on --rollbacks replay --gammas 2,4,8,16 --repeats 3 \
            --max-new-tokens 128 --prompt-len 256 --time-budget-s 135 --tag "_defer$d" --out "$dir"
    done
    SPECDEC_DEFER_COMMIT=1 step 110 exact_qwen python scripts/bench_exact.py --part tiny --models qwen --num-prompts 8 \
        --prompt-len 64 --modes exact --tag _qwen_defer1 --out "$dir"
    ;;
defer-check)  # issue 12: the deferred GDN commit as the default: the 9B cost curve again (3 runs per row, paired with AR),
    # then the call's fixed cost and step cost fitted over 32..256 new tokens
    step 150 curve_9b python scripts/bench_spec.py --random-9b --forced-acceptance 0.8,1.0 --exact on \
        --rollbacks replay --gammas 2,4,8,16 --repeats 3 --max-new-tokens 128 --prompt-len 256 --time-budget-s 135 \
        --tag _defer_default --out "$dir"
    step 120 fixed_9b python scripts/bench_fixed_cost.py --random-9b --gamma 8 --tokens 32,64,128,256 --repeats 3 \
        --tag _defer_default --out "$dir"
    ;;
packed-form)  # issue 12: the step kernel in its packed form (q, k, v read where they lie in the conv output, beta and g
    # computed in the kernel from the projection's columns: no XLA op splits them or forms the gates). (The conv form,
    # the conv and SiLU in the kernel too, ran at 3716cc0 as `conv-form`: spec_cost_curve_qwen35_9b_random_conv_form*.md.)
    # bf16 equality with AR of every Qwen chain method on the shipped checkpoint (on by default), then the 9B cost
    # curve with the form off and on, each in its own process paired with its own AR
    step 110 exact_qwen python scripts/bench_exact.py --part tiny --models qwen --num-prompts 8 --prompt-len 64 \
        --modes exact --tag _qwen_packed_form --out "$dir"
    for v in 0 1; do
        SPECDEC_GDN_PACKED_FORM=$v step 150 "curve_9b_packed$v" python scripts/bench_spec.py --random-9b \
            --forced-acceptance 0.8,1.0 --exact on --rollbacks replay --gammas 2,4,8,16 --repeats 3 \
            --max-new-tokens 128 --prompt-len 256 --time-budget-s 135 --tag "_packed_form$v" --out "$dir"
    done
    ;;
packed-form-check)  # issue 12: at the packed form's default: bf16 equality at the 9B shape at gamma 16 (n-gram and
    # forced drafts), the tiny checkpoint end to end, the 9B kernel profile (launches per step)
    step 200 exact_9b_g16 python scripts/bench_exact.py --part 9b --num-prompts 2 --gamma 16 --ar-rows 17 --repeats 1 \
        --tag _packed_form_g16 --out "$dir"
    step 150 e2e_default python scripts/bench_spec.py --model checkpoints/tiny-qwen35-code --skip-steps \
        --max-new-tokens 128 --prompts benchmarks/prompts/heldout_stdlib.json --num-prompts 8 \
        --e2e-methods ngram:4,ngram:8,mtp:4 --tag _packed_form --out "$dir"
    step 150 profile_9b python scripts/bench_spec.py --random-9b --forced-acceptance 1.0 --exact on \
        --curve-method ngram --rollbacks replay --gammas 2,8,16 --repeats 1 --max-new-tokens 64 --prompt-len 256 \
        --kernel-profile --tag _packed_form_profile --out "$dir"
    ;;
packed-form-curve)  # issue 12: the 9B cost curve at the packed form's default again, gamma <= 8 with 5 runs per row (the
    # gamma-8 p-1 row sits near its 0.95 target: 0.941 in packed-form), then gamma 8 over 256 new tokens (a call's fixed
    # cost, ~1.7 ms, spread over twice the steps)
    step 130 curve_9b python scripts/bench_spec.py --random-9b --forced-acceptance 0.8,1.0 --exact on \
        --rollbacks replay --gammas 2,4,8 --repeats 5 --max-new-tokens 128 --prompt-len 256 --time-budget-s 115 \
        --tag _packed_form_default --out "$dir"
    step 110 curve_9b_256 python scripts/bench_spec.py --random-9b --forced-acceptance 0.8,1.0 --exact on \
        --rollbacks replay --gammas 8 --repeats 3 --max-new-tokens 256 --prompt-len 256 --time-budget-s 95 \
        --tag _packed_form_default_256 --out "$dir"
    ;;
unroll-form)  # issue 12: the packed step kernel unrolled or as a loop by row count (SPECDEC_GDN_UNROLL_MAX; the kernel
    # profile at 19f68c4 gave 11.9 us per 9B layer at 9 rows unrolled against 12.2 us at 17 rows as a loop; locally the
    # unrolled 9-row kernel is 226 registers, 35 barriers, 252 KB of code, the loop 96 / 4 / 51 KB): bf16 equality of
    # every Qwen chain method with every multi-row kernel a loop, then the 9B curve at bounds 16 (the default), 8 and 2,
    # each in its own process paired with its own AR
    SPECDEC_GDN_UNROLL_MAX=2 step 100 exact_qwen python scripts/bench_exact.py --part tiny --models qwen \
        --num-prompts 8 --prompt-len 64 --modes exact --tag _qwen_unroll2 --out "$dir"
    for u in 16 8 2; do
        SPECDEC_GDN_UNROLL_MAX=$u step 140 "curve_9b_unroll$u" python scripts/bench_spec.py --random-9b \
            --forced-acceptance 0.8,1.0 --exact on --rollbacks replay --gammas 2,4,8 --repeats 3 \
            --max-new-tokens 128 --prompt-len 256 --time-budget-s 125 --tag "_unroll_max$u" --out "$dir"
    done
    ;;
step-block)  # issue 12: the packed step kernel's (block_v, warps), decode and verification alike
    # (SPECDEC_GDN_STEP_BLOCK): each setting timed at 1 / 3 / 9 / 17 rows and checked bit for bit (its verification's
    # outputs against its decode steps', the replay of its stash against their states); then the fastest exact
    # setting at 9 rows against the default (8:1): bf16 equality of every Qwen chain method, and the 9B curve of each
    # in its own process paired with its own AR
    step 220 tune python scripts/tune_packed_step.py --out "$dir"
    best=$(python -c "import json,sys; r=json.load(open(sys.argv[1])); ok={(c['block_v'],c['num_warps']) for c in \
r['checks'] if all(v for k,v in c.items() if k.endswith('equal') or 'equal_at' in k)}; \
t=[x for x in r['rows'] if x['T']==9 and (x['block_v'],x['num_warps']) in ok]; b=min(t,key=lambda x:x['us']); \
print(f\"{b['block_v']}:{b['num_warps']}\")" "$dir/tune_packed_step.json")
    echo "fastest exact setting at 9 rows: $best" | tee -a "$dir/suite.log"
    if [ "$best" != "8:1" ]; then
    SPECDEC_GDN_STEP_BLOCK=$best step 100 exact_qwen python scripts/bench_exact.py --part tiny --models qwen \
        --num-prompts 8 --prompt-len 64 --modes exact --tag _qwen_step_block --out "$dir"
    for sb in 8:1 $best; do
        SPECDEC_GDN_STEP_BLOCK=$sb step 120 "curve_9b_${sb/:/_}" python scripts/bench_spec.py --random-9b \
            --forced-acceptance 0.8,1.0 --exact on --rollbacks replay --gammas 2,4,8 --repeats 3 \
            --max-new-tokens 128 --prompt-len 256 --time-budget-s 105 --tag "_step_block_${sb/:/_}" --out "$dir"
    done
    fi
    ;;
sure-steps)  # issue 12: the speculative loop's sure steps (with no EOS id the first ceil((N - 1) / (gamma + 1)) steps
    # run whatever the acceptance) in a loop of known trip count, which XLA runs with no predicate read back per step,
    # before the loop that tests `done` (SPECDEC_SURE_STEPS): the 9B curve off and on, each in its own process paired
    # with its own AR; bf16 equality of every Qwen chain method with it on (no EOS id: the sure steps run); compile time
    # at the 9B shape (each step's program compiled twice)
    for v in 0 1; do
        SPECDEC_SURE_STEPS=$v step 125 "curve_9b_sure$v" python scripts/bench_spec.py --random-9b \
            --forced-acceptance 0.8,1.0 --exact on --rollbacks replay --gammas 2,4,8,16 --repeats 3 \
            --max-new-tokens 128 --prompt-len 256 --time-budget-s 110 --tag "_sure_steps$v" --out "$dir"
    done
    SPECDEC_SURE_STEPS=1 step 100 exact_qwen python scripts/bench_exact.py --part tiny --models qwen \
        --num-prompts 8 --prompt-len 64 --modes exact --tag _qwen_sure_steps --out "$dir"
    step $(( ${COMPILE_END_S:-480} - SECONDS )) compile_9b python scripts/bench_compile.py --random-9b \
        --methods ar,ngram,layer-skip --time-budget-s 100 --tag _sure_steps --out "$dir"
    step $(( ${TINY_END_S:-575} - SECONDS )) compile_qwen python scripts/bench_compile.py \
        --model checkpoints/tiny-qwen35-code --methods layer-skip,partial-mlp,mtp,ngram --time-budget-s 70 \
        --tag _sure_steps --out "$dir"
    ;;
pseudo-replay-check)  # issue 12: at the pseudo-value replay's defaults: bf16 equality with AR of every chain method on
    # the shipped Qwen and at the 9B shape at gamma 16 (n-gram and forced drafts), the 9B curve again, the shipped Qwen
    # end to end
    step 110 exact_qwen python scripts/bench_exact.py --part tiny --models qwen --num-prompts 8 --prompt-len 64 \
        --modes exact --tag _qwen_pseudo_replay --out "$dir"
    step 200 exact_9b_g16 python scripts/bench_exact.py --part 9b --num-prompts 2 --gamma 16 --ar-rows 17 --repeats 1 \
        --tag _pseudo_replay_g16 --out "$dir"
    step 150 curve_9b python scripts/bench_spec.py --random-9b --forced-acceptance 0.8,1.0 --exact on \
        --rollbacks replay --gammas 2,4,8,16 --repeats 2 --max-new-tokens 128 --prompt-len 256 --time-budget-s 110 \
        --tag _pseudo_replay_default --out "$dir"
    step $(( ${E2E_END_S:-570} - SECONDS )) e2e_default python scripts/bench_spec.py --model checkpoints/tiny-qwen35-code \
        --skip-steps --max-new-tokens 128 --prompts benchmarks/prompts/heldout_stdlib.json --num-prompts 8 \
        --e2e-methods ngram:4,ngram:8,mtp:4 --tag _pseudo_replay --out "$dir"
    ;;
fetch-first)  # issue 12: the step kernel issues every position's loads before it forms any step input
    # (SPECDEC_GDN_FETCH_FIRST; before, each position's loads waited behind the previous position's gates): the 9B
    # curve with it off and on, each in its own process paired with its own AR; bf16 equality of every Qwen chain
    # method with it on (ngram:16: the 17-row loop form); the 9B kernel profile
    for v in 0 1; do
        SPECDEC_GDN_FETCH_FIRST=$v step 125 "curve_9b_fetch$v" python scripts/bench_spec.py --random-9b \
            --forced-acceptance 0.8,1.0 --exact on --rollbacks replay --gammas 2,4,8,16 --repeats 3 \
            --max-new-tokens 128 --prompt-len 256 --time-budget-s 110 --tag "_fetch_first$v" --out "$dir"
    done
    step 110 exact_qwen python scripts/bench_exact.py --part tiny --models qwen --num-prompts 8 --prompt-len 64 \
        --modes exact --methods ngram,ngram:8,ngram:16,ngram-table,mtp,mtp-shortlist,layer-skip,residual-reuse,partial-mlp \
        --tag _qwen_fetch_first --out "$dir"
    step $(( ${PROFILE_END_S:-575} - SECONDS )) profile_9b python scripts/bench_spec.py --random-9b \
        --forced-acceptance 1.0 --exact on --curve-method ngram --rollbacks replay --gammas 2,8,16 --repeats 1 \
        --max-new-tokens 64 --prompt-len 256 --kernel-profile --tag _fetch_first_profile --out "$dir"
    ;;
step-ncu)  # issue 12: where the packed step kernel's time goes (Nsight Compute: warp states, per-instruction stall
    # samples), unrolled (bound 16) and as a loop (bound 2), at 1, 9 and 17 rows (9B layer shape, block 8, 1 warp)
    ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    # (no preallocation: ncu saves and restores the device memory the process holds around every replay pass)
    for u in 16 2; do
        XLA_PYTHON_CLIENT_PREALLOCATE=false SPECDEC_GDN_UNROLL_MAX=$u step 140 "ncu_unroll$u" timeout -k 5 130 \
            "$ncu_bin" --clock-control none -k regex:gdn_recurrent --section SpeedOfLight --section LaunchStats \
            --section WarpStateStats --section SourceCounters -f -o "$dir/ncu_unroll$u" \
            python scripts/tune_packed_step.py --profile-calls 1 --settings 8:1 --lengths ${NCU_LENGTHS:-9,17}
        pkill -f tune_packed_step; sleep 2
        "$ncu_bin" -i "$dir/ncu_unroll$u.ncu-rep" --page details --csv > "$dir/ncu_unroll${u}_details.csv" 2>&1
        "$ncu_bin" -i "$dir/ncu_unroll$u.ncu-rep" --page source --csv --print-source sass \
            > "$dir/ncu_unroll${u}_source.csv" 2>&1
    done
    ;;
loop-form)  # issue 12: with every position's loads issued a step ahead (fetch-first), the step kernel as a loop from 3
    # rows (SPECDEC_GDN_UNROLL_MAX=2) or 5 rows (=4) against unrolled up to 16 (the default): the 9B curve of each in its
    # own process paired with its own AR; bf16 equality of every Qwen chain method with the loop from 3 rows. (ncu, one
    # kernel in isolation, 9 rows: 13.38 us unrolled, 10.53 us as a loop; 31.8% of the unrolled kernel's warp samples
    # waited for instructions: step-ncu)
    for u in 16 2; do
        SPECDEC_GDN_UNROLL_MAX=$u step 110 "curve_9b_unroll$u" python scripts/bench_spec.py --random-9b \
            --forced-acceptance 0.8,1.0 --exact on --rollbacks replay --gammas 2,4,8 --repeats 3 \
            --max-new-tokens 128 --prompt-len 256 --time-budget-s 95 --tag "_loop_form_unroll$u" --out "$dir"
    done
    SPECDEC_GDN_UNROLL_MAX=2 step 110 exact_qwen python scripts/bench_exact.py --part tiny --models qwen \
        --num-prompts 8 --prompt-len 64 --modes exact \
        --methods ngram,ngram:8,ngram-table,mtp,mtp-shortlist,layer-skip,residual-reuse,partial-mlp \
        --tag _qwen_loop_form --out "$dir"
    SPECDEC_GDN_UNROLL_MAX=4 step $(( ${CURVE_END_S:-570} - SECONDS )) "curve_9b_unroll4" python scripts/bench_spec.py \
        --random-9b --forced-acceptance 0.8,1.0 --exact on --rollbacks replay --gammas 2,4,8 --repeats 3 \
        --max-new-tokens 128 --prompt-len 256 --time-budget-s 95 --tag "_loop_form_unroll4" --out "$dir"
    ;;
loop-form-default)  # issue 12: at the new default (the step kernel a loop from 3 rows): the 9B curve, then the tiny
    # checkpoint end to end (8 held-out prompts, 128 new tokens)
    step 115 curve_9b python scripts/bench_spec.py --random-9b --forced-acceptance 0.8,1.0 --exact on \
        --rollbacks replay --gammas 2,4,8,16 --repeats 3 --max-new-tokens 128 --prompt-len 256 --time-budget-s 100 \
        --tag _loop_form_default --out "$dir"
    step $(( ${E2E_END_S:-380} - SECONDS )) e2e_default python scripts/bench_spec.py \
        --model checkpoints/tiny-qwen35-code --skip-steps --max-new-tokens 128 \
        --prompts benchmarks/prompts/heldout_stdlib.json --num-prompts 8 --e2e-methods ngram:4,ngram:8,mtp:4 \
        --tag _loop_form --out "$dir"
    ;;
train-bptt)  # issue 15: does depth matter when the gradient reaches through the whole recurrence? The shipped 2+2+2
    # checkpoint continued (--init-from) with backprop through every sampled step (windows 32 and 48, each step's
    # activations recomputed: --remat-recurrence; the draws centre on max(mean, window): 32 and 48), side by side; held-out loss at
    # r = 1..64; both checkpoints come back as tar parts of <= 15 MiB
    step 200 corpus python scripts/build_corpus.py --out build/corpus --tokenizer checkpoints/tiny-qwen35-code
    budget=$(( ${TRAIN_END_S:-430} - SECONDS ))
    echo "training budget ${budget} s per run" | tee -a "$dir/suite.log"
    common=(--arch huginn --init-from checkpoints/tiny-huginn-code --corpus build/corpus --batch 128 --seq-len 512
            --intermediate 1024 --prelude 2 --core 2 --coda 2 --lr 1e-3 --warmup-steps 30 --seed 1 --steps 200000
            --time-budget-s "$budget" --eval-every 100 --eval-max-tokens 262144 --keep-best --log-every 25
            --remat-recurrence --eval-depths 1,2,4,8,16,32,64 ${TRAIN_ARGS:-})
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
    limit=$(( 560 - SECONDS ))
    step "$limit" train_bptt_m16 python scripts/train_tiny.py --mean-recurrence 16 --backprop-depth 32 \
        --out "$dir/ck/bptt-m16" "${common[@]}" &
    step "$limit" train_bptt_m32 python scripts/train_tiny.py --mean-recurrence 32 --backprop-depth 48 \
        --out "$dir/ck/bptt-m32" "${common[@]}" &
    wait
    for run in m16 m32; do cp "$dir/ck/bptt-$run/train_log.json" "$dir/train_log_bptt_$run.json"; done
    tar czf "$out/ck.tgz" -C "$dir" ck && split -b 15m -d "$out/ck.tgz" "$out/ck.tgz.part" && rm "$out/ck.tgz" \
        && rm -rf "$dir/ck"
    ;;
huginn-bptt-check)  # issue 15: the tiny Huginn checkpoint continued with backprop through the whole recurrence
    # (train-bptt): every lossless looped method against AR (bf16 equality, speed; exact path), DAS-Wave end to end at
    # R = 32, then one generate() call's compile time per method on both tiny checkpoints at this code
    step 120 exact_huginn python scripts/bench_exact.py --part tiny --models huginn --modes exact \
        --num-prompts 8 --prompt-len 64 --tag _huginn_bptt --out "$dir"
    step 140 looped_dw python scripts/bench_looped_spec.py --grid small --methods das-wave --num-prompts 8 \
        --time-budget-s 110 --out "$dir"
    step 80 compile_huginn python scripts/bench_compile.py --model checkpoints/tiny-huginn-code --time-budget-s 50 \
        --out "$dir"
    step $(( ${COMPILE_END_S:-510} - SECONDS )) compile_qwen python scripts/bench_compile.py \
        --model checkpoints/tiny-qwen35-code --time-budget-s 110 --out "$dir"
    ;;
train-depth-curve)  # issue 15: does the r = 4 - r = 32 gap keep growing with training, and does depth matter once no
    # draw is shallow? The shipped checkpoint continued with its own recipe (mean 16, window 32) and with every draw
    # >= 32 (--min-recurrence 32, window 32), side by side, held-out loss at r = 4, 8, 32 every 100 steps. LEG=2
    # continues each leg-1 run (build/stage, kept on a warm machine) for a second leg; checkpoints come back as tar parts
    step 200 corpus python scripts/build_corpus.py --out build/corpus --tokenizer checkpoints/tiny-qwen35-code
    leg=${LEG:-1}
    budget=$(( ${TRAIN_END_S:-440} - SECONDS ))
    echo "leg $leg: training budget ${budget} s per run" | tee -a "$dir/suite.log"
    common=(--arch huginn --corpus build/corpus --batch 128 --seq-len 512 --intermediate 1024 --prelude 2 --core 2
            --coda 2 --lr 1e-3 --warmup-steps 30 --seed "$leg" --steps 200000 --time-budget-s "$budget" --eval-every 100
            --eval-max-tokens 262144 --keep-best --log-every 25 --remat-recurrence --backprop-depth 32
            --periodic-eval-depths 4,8,32 --eval-depths 1,2,4,8,16,32,64 ${TRAIN_ARGS:-})
    export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
    limit=$(( ${LIMIT_END_S:-570} - SECONDS ))
    for run in w32 floor32; do
        init=checkpoints/tiny-huginn-code
        if [ "$leg" != 1 ]; then
            init=build/stage/$run-leg$((leg - 1))
            [ -f "$init/model.safetensors" ] || { echo "leg $leg: $init missing (machine not warm)" | tee -a "$dir/suite.log"; continue; }
        fi
        extra=(--mean-recurrence 16)
        [ "$run" = floor32 ] && extra=(--mean-recurrence 32 --min-recurrence 32)
        step "$limit" "train_${run}_leg$leg" python scripts/train_tiny.py "${extra[@]}" --init-from "$init" \
            --out "build/stage/$run-leg$leg" "${common[@]}" &
    done
    wait
    mkdir -p "$dir/ck"
    for run in w32 floor32; do
        [ -d "build/stage/$run-leg$leg" ] || continue
        cp "build/stage/$run-leg$leg/train_log.json" "$dir/train_log_${run}_leg$leg.json"
        cp -r "build/stage/$run-leg$leg" "$dir/ck/"
    done
    python - "$dir" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("train_log_*.json")):
    d = json.loads(f.read_text())
    print(f.stem, "steps", d["summary"].get("steps"))
    for e in d["evals"]:
        c = e.get("ce_per_depth") or {}
        if c:
            print(f"  step {e['step']:5d}  r4 {c['4']:.4f} r8 {c['8']:.4f} r32 {c['32']:.4f}  r4-r32 {c['4'] - c['32']:.4f}"
                  f"  r8-r32 {c['8'] - c['32']:.4f}")
    pd = d["summary"].get("eval", {}).get("per_depth") or {}
    print("  final", {k: round(v["ce"], 4) if isinstance(v, dict) else v for k, v in pd.items()})
PY
    tar czf "$out/ck.tgz" -C "$dir" ck && split -b 15m -d "$out/ck.tgz" "$out/ck.tgz.part" && rm "$out/ck.tgz" \
        && rm -rf "$dir/ck"
    ;;
*)
    echo "unknown part $part" >&2
    exit 2
    ;;
esac
tar czf "$out/$part.tgz" -C "$out" "$part"  # (each step's line is already on stdout: step() tees it)
