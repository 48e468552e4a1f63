#!/usr/bin/env bash
# The GPU path's checks and figures (issue 41) in one call on a GPU machine, each under its own time limit; each
# step's log is written to OUTDIR and its end printed. From the checkout's root, with aqpipe's dependencies importable
# (and the built-in corpus in AQPIPE_CACHE where the machine cannot reach PyPI); ONLY="step ..." runs some steps:
#     bash benchmarks/gpu_checks.sh OUTDIR
set -u
out=${1:?usage: bash benchmarks/gpu_checks.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
work=$(mktemp -d)

step() {  # name, seconds, command...
    local name=$1 limit=$2 start rc
    shift 2
    [[ -z "${ONLY:-}" || " $ONLY " == *" $name "* ]] || return 0
    start=$(date +%s)
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    echo "== $name rc=$rc $(($(date +%s) - start))s"
    grep -v -e "it/s\]" -e "^\s*$" "$out/$name.log" | tail -n 30
}

dp_rows() {  # the tied 114M Llama at 2 stages x 2 replicas sharing the GPU: QAdam past a 2-step warm-up, allreduce
    python3 -c "from pathlib import Path; from benchmarks.rank_memory import write_model; write_model('llama', Path('$work/llama'))" || return 1
    local algo
    for algo in qadam allreduce; do
        python3 -m torch.distributed.run --nproc_per_node 4 --master_port 29733 -m aqpipe causal-lm \
            --model "$work/llama" --seq_len 128 --micro_batch_size 2 --num_micro_batches 4 --max_train_samples 128 \
            --max_eval_samples 8 --max_steps 8 --backend gloo --replicas 2 --dp_warmup_steps 2 --dp_algorithm $algo \
            --output_dir "$work/$algo" >"$work/$algo.log" 2>&1 || { tail -n 20 "$work/$algo.log"; return 1; }
        python3 -c "import json; print('$algo', [round(json.loads(l)['loss'], 4) for l in open('$work/$algo/metrics.jsonl') if '\"lr\"' in l])"
    done
}

python3 -c "import torch, triton, transformers, numpy; print(torch.__version__, torch.cuda.get_device_name(), 'triton', triton.__version__, 'transformers', transformers.__version__, 'numpy', numpy.__version__)"
step gpu_tests 300 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -rs ${GPU_TESTS:+-k "$GPU_TESTS"}
step bench_quantize 120 python3 -m benchmarks.bench_quantize --device cuda --backends triton,torch --shape 16,1024,1600 --bits 2,4,8 \
    --sweep 2048x4,2048x8,4096x4,4096x8,8192x8
step aqsgd_messages 90 python3 -m benchmarks.aqsgd_messages --device cuda --shape 4,1024,2048 --micro_batches 4 --layers 8
step step_profile 240 python3 -m benchmarks.step_profile --device cuda --shape 1b --bf16 --micro_batch_size 4 \
    --num_micro_batches 4 --seq_len 1024 --json "$out/step_profile.json"
step optimizer_step 90 python3 -m benchmarks.optimizer_step --device cuda --shape 1b --json "$out/optimizer_step.json"
step head_loss 240 python3 -m benchmarks.head_loss --device cuda --rows 4 --positions 1024 --hidden 2048 \
    --vocab 128256 --bf16 --chunk_mib 256
step step_overhead 420 python3 -m benchmarks.step_overhead --device cuda --shape 1b --bf16 --micro_batch_size 4 \
    --num_micro_batches 4 --seq_len 1024 --steps 10 \
    --variants ",--param_dtype=bfloat16,--compile,--param_dtype=bfloat16 --compile,--use_liger_kernel,--compile --use_liger_kernel" \
    --json "$out/step_overhead.json"
step big_job 540 python3 -m benchmarks.big_job --work "$work/big_job" --json "$out/big_job.json"
export -f dp_rows
export work
step dp_rows 150 bash -c dp_rows
step unit_tests 120 python3 -m pytest -q -n 12 tests/unit -p no:cacheprovider
rm -rf "$work"
