#!/usr/bin/env bash
# Hugging Face models on one GPU (issue 18): mirage against eager and Inductor's modes, plus the gpu-marked tests.
#
#   [DYNAMIC=auto|false|default] [CACHE=static|dynamic] [MODES=mirage,reduce-overhead] benchmarks/hf_models_gpu.sh quick   # ≈8 min: gpu tests, then llama,gemma2,gpt2,bert, default attention,
#                                       # eager/inductor/reduce-overhead/mirage, prefill 4×256 + 16 greedy tokens
#   benchmarks/hf_models_gpu.sh full MODELS [ATTN]   # every mode incl. max-autotune (one 10-min command per
#                                                    # model or two), e.g. full qwen2,mistral default,eager
#
# Writes $OUT/hf_models*.{json,md,png,log} (benchmarks/results/raw/ without $OUT); the JSON is rewritten after
# every case and no new case starts after BUDGET_S seconds, so a run cut short still leaves its results.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUTDIR=${OUT:-benchmarks/results/raw}
mkdir -p "$OUTDIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PART=${1:-quick}
case "$PART" in
  quick)
    "$PY" -m pytest tests/test_cudagraph_rules.py -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUTDIR/hf_models_gpu_tests.log" || true
    # one process per model: a crash (seen once: a segfault after Inductor's reduce-overhead) loses one model
    start=$SECONDS; parts=()
    for model in ${MODELS:-llama gemma2 gpt2 bert}; do
      if (( SECONDS - start > ${BUDGET_S:-240} )); then echo "$model: not run (BUDGET_S spent)"; continue; fi
      "$PY" -X faulthandler -m torch_mirage.bench.models --models "$model" --attn default \
        --modes "${MODES:-eager,inductor,reduce-overhead,mirage}" --new-tokens 16 --dynamic "${DYNAMIC:-auto}" --cache "${CACHE:-static}" \
        --out "$OUTDIR" --name "hf_models_$model" 2>&1 | grep -v "cudagraph_utils.py" | tee -a "$OUTDIR/hf_models.log" \
        || echo "$model: exit ${PIPESTATUS[0]}" | tee -a "$OUTDIR/hf_models.log"
      [[ -f "$OUTDIR/hf_models_$model.json" ]] && parts+=("$OUTDIR/hf_models_$model.json")
    done
    (( ${#parts[@]} )) && "$PY" -m torch_mirage.bench.models --merge "${parts[@]}" --out "$OUTDIR" --name hf_models \
      && rm -f "${parts[@]}" "${parts[@]/%.json/.md}" "${parts[@]/%.json/.png}"
    ;;
  full)
    MODELS=${2:?usage: $0 full MODELS [ATTN]}
    "$PY" -m torch_mirage.bench.models --models "$MODELS" --attn "${3:-default,eager}" \
      --budget-s "${BUDGET_S:-420}" --out "$OUTDIR" --name "hf_models_${MODELS//,/_}" 2>&1 \
      | tee "$OUTDIR/hf_models_${MODELS//,/_}.log"
    ;;
  *) echo "usage: $0 quick | full MODELS [ATTN]" >&2; exit 2 ;;
esac
