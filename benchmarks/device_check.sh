#!/usr/bin/env bash
# One device call: install carried wheels and the package, then run the named steps, each under its own
# time limit (STEP_LIMIT_S, or step@SECONDS), logging to $OUT/<step>.log.
# Steps: gputests gpushards:<N> (the gpu suite in N parallel pytest processes; GPU_IDS=<file of test ids>: those only) gputest:<pytest -k expr> pytest:<pytest args> stitch stitchq stitchsweep mirageset mirageprofile bench:<part>
#        layerkernels:<batch> (benchmarks/layer_kernels_gpu.py) llmab:<args of benchmarks/llm_ab.py> attnprobe:<args of benchmarks/attention_probe.py>
#        attnkernel:<args of benchmarks/attention_kernel_gpu.py> pdlprobe:<args of benchmarks/pdl_probe.py>
#        afterinductor:<args of benchmarks/compile_after_inductor.py> siblingpairs:<args of benchmarks/sibling_pairs_gpu.py>
#        memorypeak:<bench cli args> (benchmarks/memory_peak_gpu.py: the call sites alive at the run's GPU memory peak)
#        sdpaprobe:<args of benchmarks/sdpa_choice_probe.py> (the SDPA op an HF model's ATen graph holds, and why)
#        maskprobe:<args of benchmarks/mask_form_probe.py> (the mask form each attention region of an HF model takes here)
#        guardprobe:<args of benchmarks/guard_probe.py> (the whole-graph guard's versions: host, loop and device time)
#        serving:<args of benchmarks/serving_sizes_gpu.py> (prefill at several prompt lengths under dynamic=None)
#        fuzz:<args of benchmarks/fuzz_backend.py> (random programs compiled on the GPU against float64)
#        dyncache:<args of benchmarks/dynamic_cache_generate_gpu.py> (generate with a DynamicCache, per MIRAGE_CUDA_GRAPH_RECORD_AT)
#        hfprofile:<args of benchmarks/hf_decode_profile.py> (one generate per mode under torch.profiler: host vs GPU)
#        pertoken:<args of benchmarks/per_token_alone.py> (µs/token with each mode alone in Dynamo's cache and shared)
#        hf:<models, e.g. qwen2,phi3> (the HF model bench,
#        default attention, one process per model; MIRAGE_LOG_LEVEL=INFO logs each tuned choice's compile seconds)
#        (quote a step with spaces as one argument).
#   benchmarks/device_check.sh gputests@400 stitch mirageset
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/device.txt"
failed=()
n_step=0
for arg in "$@"; do
  step=${arg%@*}; LIMIT=${STEP_LIMIT_S:-280}; n_step=$((n_step + 1))
  [[ $arg == *@* ]] && LIMIT=${arg##*@}     # step@SECONDS: this step's own limit
  echo "== $step (limit ${LIMIT}s)"
  # file names stay short; the step's number keeps two runs of one step (cold, then warm) apart
  log="$OUT/$n_step-$(printf %s "$step" | tr -c 'A-Za-z0-9_.-' _ | cut -c1-72).log"
  case "$step" in
    gputests) timeout "$LIMIT" python3 -m pytest tests -q -m gpu -p no:cacheprovider ;;
    gpushards:*)   # the gpu suite in N pytest processes at once (Triton compiles are CPU-bound; the GPU is shared);
                   # the tests that measure the GPU itself (gpu_alone) run first, with the GPU to themselves
      n=${step#gpushards:}; d=$(mktemp -d)
      [[ -n ${GPU_IDS:-} ]] && : > "$d/alone.log" || timeout "$LIMIT" python3 -m pytest tests -q -m "gpu and gpu_alone" -p no:cacheprovider > "$d/alone.log" 2>&1
      echo "alone rc=$?" >> "$d/alone.log"; sed -i 's/alone rc=5$/alone rc=0/' "$d/alone.log"   # 5: none collected
      if [[ -n ${GPU_IDS:-} ]]; then cp "$GPU_IDS" "$d/ids"   # GPU_IDS=file: only these tests (one id a line), e.g. the rest of a cut run
      else python3 -m pytest tests -q -m "gpu and not gpu_alone" -p no:cacheprovider --collect-only 2>/dev/null | grep '::' > "$d/ids"; fi
      for i in $(seq 0 $((n - 1))); do
        awk -v n="$n" -v i="$i" 'NR % n == i' "$d/ids" > "$d/ids$i"   # ids may hold spaces: one per line
        ( mapfile -t ids < "$d/ids$i"; timeout "$LIMIT" python3 -m pytest -v -p no:cacheprovider --durations=8 -o faulthandler_timeout=${FAULT_S:-120} "${ids[@]}" \
            > "$d/shard$i.log" 2>&1; echo "shard $i rc=$?" >> "$d/shard$i.log" ) &
      done
      wait; cat "$d"/alone.log "$d"/shard*.log; ! grep -q 'rc=[^0]' "$d"/alone.log "$d"/shard*.log ;;
    gputest:*) timeout "$LIMIT" python3 -m pytest tests -q -m gpu -p no:cacheprovider -k "${step#gputest:}" ;;
    pytest:*) timeout "$LIMIT" python3 -m pytest -q -p no:cacheprovider ${step#pytest:} ;;   # CPU tests run on CUDA too
    stitch)   timeout "$LIMIT" python3 benchmarks/stitch_gpu_check.py ;;
    stitchsweep) timeout "$LIMIT" python3 benchmarks/stitch_gpu_check.py --sweep ;;
    stitchq)  timeout "$LIMIT" python3 benchmarks/stitch_gpu_check.py --quick ;;
    sweep:*)  timeout "$LIMIT" python3 benchmarks/ugraph_config_sweep.py ${step#sweep:} ;;   # "sweep:--workload W --batches 1" splits
    mirageset) timeout "$LIMIT" python3 benchmarks/mirage_set_gpu.py --limit 2 ;;
    mirageprofile) timeout "$LIMIT" python3 benchmarks/mirage_set_gpu.py --limit 2 --profile --no-max-autotune ;;
    attnprobe:*) timeout "$LIMIT" python3 benchmarks/attention_probe.py ${step#attnprobe:} ;;
    attnkernel:*) timeout "$LIMIT" python3 benchmarks/attention_kernel_gpu.py ${step#attnkernel:} ;;
    hf:*)     models=${step#hf:}; MODELS="${models//,/ }" BUDGET_S=$((LIMIT - 60)) PYTHON=python3 timeout "$LIMIT" bash benchmarks/hf_models_gpu.sh quick ;;
    layerkernels:*) timeout "$LIMIT" python3 benchmarks/layer_kernels_gpu.py ${step#layerkernels:} ;;
    llmab:*)  timeout "$LIMIT" python3 benchmarks/llm_ab.py ${step#llmab:} ;;   # "llmab:--model M --scenario S" splits
    pdlprobe:*) OUT="$OUT" timeout "$LIMIT" python3 benchmarks/pdl_probe.py ${step#pdlprobe:} ;;   # "pdlprobe:" = defaults
    siblingpairs:*) timeout "$LIMIT" python3 benchmarks/sibling_pairs_gpu.py ${step#siblingpairs:} ;;   # "siblingpairs:--batch 8"
    memorypeak:*) timeout "$LIMIT" python3 benchmarks/memory_peak_gpu.py --out "$OUT/memorypeak" ${step#memorypeak:} ;;
    sdpaprobe:*) timeout "$LIMIT" python3 benchmarks/sdpa_choice_probe.py ${step#sdpaprobe:} ;;   # "sdpaprobe:" = bert
    maskprobe:*) timeout "$LIMIT" python3 benchmarks/mask_form_probe.py ${step#maskprobe:} ;;   # "maskprobe:--model bloom"
    guardprobe:*) timeout "$LIMIT" python3 benchmarks/guard_probe.py ${step#guardprobe:} ;;   # "guardprobe:--model bert"
    fuzz:*) timeout "$LIMIT" python3 benchmarks/fuzz_backend.py --device cuda ${step#fuzz:} ;;   # "fuzz:--seeds 0:10 --dtype bfloat16"
    dyncache:*) timeout "$LIMIT" python3 benchmarks/dynamic_cache_generate_gpu.py --out "$OUT" ${step#dyncache:} ;;   # "dyncache:" = llama, record_at 1 and 2
    serving:*) timeout "$LIMIT" python3 benchmarks/serving_sizes_gpu.py --out "$OUT" ${step#serving:} ;;   # "serving:--model llama"
    pertoken:*) timeout "$LIMIT" python3 benchmarks/per_token_alone.py --out "$OUT" ${step#pertoken:} ;;   # "pertoken:--model qwen2"
    hfprofile:*) timeout "$LIMIT" python3 benchmarks/hf_decode_profile.py ${step#hfprofile:} ;;   # "hfprofile:--model qwen2"
    afterinductor:*) timeout "$LIMIT" python3 benchmarks/compile_after_inductor.py ${step#afterinductor:} ;;   # "afterinductor:--profile"
    bench:*)  BUDGET_S=$((LIMIT - 40)) timeout "$LIMIT" bash benchmarks/run_h100.sh ${step#bench:} ;;   # "bench:PART ARGS..." splits
    *) echo "unknown step $step"; (exit 2) ;;
  esac > "$log" 2>&1
  rc=$?; echo "rc=$rc"; tail -25 "$log"; (( rc )) && failed+=("$step (rc $rc)")
  # only 8 files come back from a device call: keep the JSON, the table and the step log
  rm -f "$OUT"/*.png "$OUT"/*.gpu.txt
  if [[ $step == bench:* ]]; then
    part=${step#bench:}; part=${part%% *}
    rm -f "$OUT/$part.log" "$OUT/$part.md"    # the step log holds the part's log; merge rebuilds the table
    [[ -f "$OUT/$part.json" ]] && mv "$OUT/$part.json" "$OUT/$n_step-$part.json"   # a later run of the part keeps it
  fi
done
(( ${#failed[@]} )) && { printf 'failed step: %s\n' "${failed[@]}"; exit 1; }
exit 0
