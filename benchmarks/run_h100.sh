#!/usr/bin/env bash
# The full benchmark run on one H100, in parts that each fit one 10-minute device command.
#
#   benchmarks/run_h100.sh PART [EXTRA BENCH ARGS]
#       PART: fp16-b1-a fp16-b1-b fp16-b8-a fp16-b8-b bf16-b1-a bf16-b1-b bf16-b8-a bf16-b8-b
#             llm-llama llm-qwen2 llm-gemma2
#             llm-llama-mat llm-qwen2-mat llm-gemma2-mat (Inductor max-autotune on the LLMs: merged in as a column)
#       extra args override the part's (e.g. --workloads X Y to redo what a part left "not run")
#   benchmarks/run_h100.sh merge DIR [NAME]   (on any machine) merge DIR/*.json into benchmarks/results/NAME.*
#       (NAME: h100 by default; h200 for runs on the H200 the device tool lends since 2026-11-28)
#
# Each part writes $OUT/PART.{json,md,png} and $OUT/PART.log (benchmarks/results/raw/ without $OUT).
# Every part stops starting new cases after BUDGET_S seconds (default 540) and lists what it skipped,
# and the JSON is rewritten after every case, so a part cut short still leaves its results.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUTDIR=${OUT:-benchmarks/results/raw}
BUDGET_S=${BUDGET_S:-540}
PART=${1:?usage: $0 PART [ARGS] | merge DIR   (PART: fp16-bN-G bf16-bN-G with N 1 or 8, G a or b; llm-llama llm-qwen2 llm-gemma2 llm-MODEL-mat)}
shift
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

bench() {   # bench NAME ARGS...
  local name=$1; shift
  mkdir -p "$OUTDIR"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >"$OUTDIR/$name.gpu.txt" 2>&1 || true
  "$PY" -m torch_mirage.bench.cli --out "$OUTDIR" --name "$name" --budget-s "$BUDGET_S" "$@" 2>&1 | tee "$OUTDIR/$name.log"
}

GROUP_A="rmsnorm_linear gated_mlp gated_mlp_llama8b gqa qknorm_attention lora ntrans"
GROUP_B="bias_residual_layernorm bert_softmax bias_gelu h2o_core gemma2_softcap llama_layer_decode"
case "$PART" in
  fp16-b[18]-[ab]|bf16-b[18]-[ab])    # DTYPE-bBATCH-GROUP
    dtype=${PART%%-*}; dtype=${dtype/fp16/float16}; dtype=${dtype/bf16/bfloat16}
    batch=${PART#*-b}; batch=${batch%%-*}
    group=GROUP_${PART##*-}; group=${group^^}
    bench "$PART" --dtype "$dtype" --batch "$batch" --workloads ${!group} --llms none "$@" ;;
  llm-llama)  bench "$PART" --workloads none --llms llama3-8b-4l --batch 1 8 "$@" ;;
  llm-qwen2)  bench "$PART" --workloads none --llms qwen2-7b-4l --batch 1 8 "$@" ;;
  llm-gemma2) bench "$PART" --workloads none --llms gemma2-9b-4l --batch 1 8 "$@" ;;
  llm-*-mat)
    model=${PART#llm-}; model=${model%-mat}
    case "$model" in llama) model=llama3-8b-4l ;; qwen2) model=qwen2-7b-4l ;; gemma2) model=gemma2-9b-4l ;; esac
    bench "$PART" --workloads none --llms "$model" --batch 1 8 --llm-modes inductor-max-autotune "$@" ;;
  merge)
    DIR=${1:?usage: $0 merge DIR_WITH_PART_JSONS}
    "$PY" -m torch_mirage.bench.cli --merge "$DIR"/*.json --out benchmarks/results --name "${2:-h100}" ;;
  *) echo "unknown part $PART" >&2; exit 2 ;;
esac
