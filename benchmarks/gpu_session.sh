#!/usr/bin/env bash
# Everything BENCHMARKS.md reports, measured on one GPU machine, in steps:
#   OUT=dir STEPS="evals tests" bash benchmarks/gpu_session.sh      (or "run hf dask")
# evals  `evoattn eval` of every shipped seed (every timing mode, every baseline), JSON each
# crosscheck  the same seeds (the sdpa default aside: benchmarks.check_bf16_cuda) against their
#        baselines by do_bench (benchmarks.crosscheck), JSON each
# model  the model problems' seeds (Gemma 2 / GPT-OSS features), evaluated and cross-checked
# tests  the gpu-marked tests (GPU_TEST_FILES picks; the decode ones take about 100 s)
# run    the default search (call time) for RUN_S seconds, then the best re-evaluated by
#        `evoattn eval`, its export and its report
# seed   the default seed alone: a 0-iteration run of configs/default.yaml (the seed checked
#        and exported: what `hf` and `op` need, without a search)
# hf     the exported best inside a Hugging Face Llama model (benchmarks.hf_model), eager
#        and compiled (HF_COMPILE="" for eager only), the kernel gain cross-checked by do_bench
# op     the exported best's op against SDPA per default config (benchmarks.op_calls)
# dask   a short search through a Dask scheduler and one GPU worker on this machine
# noise  the default seed evaluated stand-alone and as a candidate in runs (benchmarks.noise)
# protocol  SDPA in the evaluator against a plain eager loop and do_bench (benchmarks.protocol_check)
# contention  an honest candidate while other processes use the GPU (benchmarks.contention)
# decode the decode seed's bandwidth against the baselines (benchmarks.decode_bw), both dtypes
# decode_gen  greedy generation through the exported decode seed over the dynamic cache, the
#        static cache eager and compiled (benchmarks.decode_generate; GEN_CACHES from dynamic,
#        static_eager, static; GEN_DTYPES pick; about 160 s each); after `seed` or `run`,
#        the prompt through that export's kernel
# decode_step  one decode step over a static cache, eager and compiled by us, timed by do_bench
#        and a plain loop (benchmarks.decode_step): the cross-check of decode_gen's static rows.
#        The decode steps export the decode seed by a
#        0-iteration run first (the seed checked and exported), where this machine has none yet
# A device call runs at most 10 minutes: give a call the steps that fit (each step's timeouts
# say how long it may take), e.g. STEPS="noise", then STEPS="decode", then STEPS="decode_gen"
# GEN_CACHES="dynamic static_eager", then STEPS=decode_gen GEN_CACHES=static.
# Results land in $OUT/results.tgz. Unpack it into benchmarks/results/ (git ignores it), then
#   python -m benchmarks.make_page collect benchmarks/results && python -m benchmarks.make_page page
# writes benchmarks/current.json and BENCHMARKS.md's tables from it.
# Packages the machine lacks (dask, distributed) come as wheels in .whl/ (see the device tool).
set -u
export PYTHONUNBUFFERED=1
R=$OUT/res; mkdir -p "$R"
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
if ls .whl/*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  date -u; git rev-parse --short HEAD 2>/dev/null; } | tee "$R/machine.txt"
export EVOATTN_CACHE=/tmp/evoattn-cache
ev() {  # name, then evoattn eval arguments
  local name=$1; shift
  log "eval $name"
  timeout "${EVAL_S:-150}" python -m evoattn.cli eval "$@" --json "$R/eval_$name.json" \
    > "$R/eval_$name.txt" 2>&1
  echo "exit $?" >> "$R/eval_$name.txt"; tail -4 "$R/eval_$name.txt"
}
for step in ${STEPS:-evals tests}; do
case $step in
evals)
  ev sdpa_flash_hybrid seeds/sdpa/flash_hybrid.py
  ev sdpa_flash_triton seeds/sdpa/flash_triton.py --reps 30
  ev strided seeds/strided/strided_triton.py --problem strided --reps 30
  ev sliding_window seeds/sliding_window/window_triton.py --problem sliding_window --reps 30
  ev masked seeds/masked/masked_triton.py --problem masked --reps 30
  ev gqa seeds/gqa/gqa_triton.py --problem gqa --reps 30
  ev mha seeds/mha/fused_triton.py --problem mha --reps 30
  ev alibi seeds/alibi/alibi_triton.py --problem alibi --reps 30
  ev softcap examples/softcap/seed.py --problem examples/softcap/problem.py --reps 30
  ;;
crosscheck)
  cc() {  # name, then benchmarks.crosscheck arguments
    local name=$1; shift
    log "crosscheck $name"
    timeout "${CC_S:-150}" python -m benchmarks.crosscheck "$@" --json "$R/cc_$name.json" \
      > "$R/cc_$name.txt" 2>&1
    echo "exit $?" >> "$R/cc_$name.txt"; tail -2 "$R/cc_$name.txt"
  }
  cc sdpa_flash_triton seeds/sdpa/flash_triton.py
  cc strided seeds/strided/strided_triton.py --problem strided
  cc sliding_window seeds/sliding_window/window_triton.py --problem sliding_window
  cc masked seeds/masked/masked_triton.py --problem masked
  cc gqa seeds/gqa/gqa_triton.py --problem gqa
  cc mha seeds/mha/fused_triton.py --problem mha
  cc alibi seeds/alibi/alibi_triton.py --problem alibi
  cc softcap examples/softcap/seed.py --problem examples/softcap/problem.py
  ;;
model)   # the model problems (Gemma 2 / GPT-OSS features): evaluated and cross-checked, bfloat16 timed
  EVAL_S=${EVAL_S:-300} ev model seeds/model/model_triton.py --problem model \
    --dtype bfloat16 --dtype float16
  EVAL_S=${EVAL_S:-300} ev model_decode seeds/model/model_decode_triton.py \
    --problem model_decode --dtype bfloat16 --dtype float16
  for p in model model_decode; do
    log "crosscheck $p"
    seed=seeds/model/model_triton.py; [ $p = model_decode ] && seed=seeds/model/model_decode_triton.py
    timeout "${CC_S:-200}" python -m benchmarks.crosscheck $seed --problem $p --dtype bfloat16 \
      --json "$R/cc_$p.json" > "$R/cc_$p.txt" 2>&1
    echo "exit $?" >> "$R/cc_$p.txt"; tail -3 "$R/cc_$p.txt"
  done
  ;;
masked_evals)   # the masked, sparse and biased problems only
  ev strided seeds/strided/strided_triton.py --problem strided --reps 30
  ev sliding_window seeds/sliding_window/window_triton.py --problem sliding_window --reps 30
  ev softcap examples/softcap/seed.py --problem examples/softcap/problem.py --reps 30
  ;;
tests)
  log "gpu tests"
  timeout "${TESTS_S:-540}" python -m pytest -q -m gpu -p no:cacheprovider \
    ${GPU_TEST_FILES:-tests/test_adversarial.py tests/test_seeds_gpu.py tests/test_export_package_gpu.py tests/test_decode.py tests/test_export_decode.py} \
    > "$R/gpu_tests.txt" 2>&1
  echo "exit $?" >> "$R/gpu_tests.txt"; tail -6 "$R/gpu_tests.txt"
  ;;
run)
  log "default run"
  timeout $(( ${RUN_S:-300} + 120 )) python -m evoattn.cli run --config configs/default.yaml \
    --max-wall-s "${RUN_S:-300}" --quiet --output /tmp/run-default > "$R/run.txt" 2>&1
  echo "exit $?" >> "$R/run.txt"; tail -24 "$R/run.txt"
  cp /tmp/run-default/run.sqlite "$R/run.sqlite" 2>/dev/null
  ev best /tmp/run-default/best/best.py
  log report; timeout 60 python -m evoattn.cli report /tmp/run-default --out "$R/report" \
    > /dev/null 2>&1 || echo "report failed"
  cp -r /tmp/run-default/best "$R/export" 2>/dev/null
  ;;
seed)
  log "seed export"
  timeout "${SEED_S:-300}" python -m evoattn.cli run --config configs/default.yaml --iterations 0 \
    --quiet --output /tmp/run-default > "$R/seed.txt" 2>&1
  echo "exit $?" >> "$R/seed.txt"; tail -8 "$R/seed.txt"
  cp /tmp/run-default/best/best_eval.json "$R/seed_best_eval.json" 2>/dev/null
  ;;
hf)
  for h in ${HF_HIDDEN:-4096 2048}; do
    log "hf model hidden=$h"
    timeout "${HF_S:-300}" python -m benchmarks.hf_model --export /tmp/run-default/best \
      --device cuda --hidden $h --seqs "${HF_SEQS:-1000,3000,6000}" ${HF_COMPILE---compile --dynamic} \
      --runs ${HF_RUNS:-5} --warmup 2 --cross-check ${HF_XCHECK:-3} --json "$R/hf_h$h.json" \
      > "$R/hf_h$h.txt" 2>&1
    echo "exit $?" >> "$R/hf_h$h.txt"; grep -v Warning "$R/hf_h$h.txt" | tail -16
  done
  ;;
op)
  # the exported op as a user calls it (needs `seed` or `run` first): host µs and eager time per
  # call against SDPA, both dtypes; transformers' layout with GQA; the fallback alone
  for how in "--layout bhsd" "--layout model" "--layout bhsd --fallback"; do
    name=$(echo "$how" | tr -d ' -')
    log "op calls $how"
    timeout "${OP_S:-300}" python -m benchmarks.op_calls --export /tmp/run-default/best $how --pin-cpu \
      --json "$R/op_$name.json" > "$R/op_$name.txt" 2>&1
    echo "exit $?" >> "$R/op_$name.txt"; tail -3 "$R/op_$name.txt"
  done
  ;;
noise)
  log "noise"
  timeout "${NOISE_S:-540}" python -m benchmarks.noise seeds/sdpa/flash_hybrid.py --standalone 5 \
    --in-run 5 --out "$R/noise.json" > "$R/noise.txt" 2>&1
  echo "exit $?" >> "$R/noise.txt"; tail -20 "$R/noise.txt"
  ;;
protocol|contention)
  script=protocol_check; [ "$step" = contention ] && script=contention
  log "$script"
  timeout "${PROTO_S:-540}" python -m "benchmarks.$script" --out "$R/$script.json" \
    > "$R/$script.txt" 2>&1
  echo "exit $?" >> "$R/$script.txt"; tail -20 "$R/$script.txt"
  ;;
decode|decode_gen|decode_step)
  if [ ! -f /tmp/run-decode/best/export.json ]; then
    log "decode seed export"
    timeout "${SEED_S:-300}" python -m evoattn.cli run --config configs/decode.yaml \
      --iterations 0 --quiet --output /tmp/run-decode > "$R/decode_seed.txt" 2>&1
    echo "exit $?" >> "$R/decode_seed.txt"; tail -8 "$R/decode_seed.txt"
  fi
  if [ "$step" = decode_step ]; then
    log "decode_step"
    timeout "${STEP_S:-400}" python -m benchmarks.decode_step --export /tmp/run-decode/best \
      --dtypes "${GEN_DTYPES:-float16,bfloat16}" ${STEP_ARGS:-} --out "$R/decode_step.json" \
      > "$R/decode_step.txt" 2>&1
    echo "exit $?" >> "$R/decode_step.txt"; grep -v Warning "$R/decode_step.txt" | tail -16
  elif [ "$step" = decode ]; then
    for dt in ${DECODE_DTYPES:-float16 bfloat16}; do
      log "decode_bw $dt"
      timeout "${DECODE_S:-280}" python -m benchmarks.decode_bw --dtype $dt \
        --out "$R/decode_bw_$dt.json" > "$R/decode_bw_$dt.txt" 2>&1
      echo "exit $?" >> "$R/decode_bw_$dt.txt"; tail -4 "$R/decode_bw_$dt.txt"
    done
  else
    pre=""     # after `seed` or `run`: the prompt through the sdpa export's kernel
    [ -f /tmp/run-default/best/export.json ] && pre="--prefill-export /tmp/run-default/best"
    for cache in ${GEN_CACHES:-dynamic static_eager}; do
      log "decode_generate $cache"
      how="--cache ${cache%_eager}"; [ "$cache" = static_eager ] && how="$how --eager"
      timeout "${GEN_S:-280}" python -m benchmarks.decode_generate \
        --export /tmp/run-decode/best $pre $how \
        --dtypes "${GEN_DTYPES:-float16,bfloat16}" --out "$R/decode_gen_$cache.json" \
        > "$R/decode_gen_$cache.txt" 2>&1
      echo "exit $?" >> "$R/decode_gen_$cache.txt"
      grep -v Warning "$R/decode_gen_$cache.txt" | tail -4
    done
  fi
  ;;
dask)
  log "dask"
  (python -m dask scheduler --port 8786 > "$R/dask_scheduler.txt" 2>&1 &)
  sleep 5
  (CUDA_VISIBLE_DEVICES=0 python -m dask worker tcp://127.0.0.1:8786 --resources GPU=1 --nthreads 1 \
     > "$R/dask_worker.txt" 2>&1 &)
  sleep 8
  printf 'problem: sdpa\nseed: %s/seeds/sdpa/flash_hybrid.py\niterations: 100\noutput: /tmp/run-dask\nevaluator: {backend: dask, scheduler_address: "tcp://127.0.0.1:8786", reps: 30, warmup: 5}\n' \
    "$PWD" > /tmp/dask.yaml
  timeout $(( ${DASK_S:-90} + 90 )) python -m evoattn.cli run --config /tmp/dask.yaml \
    --max-wall-s "${DASK_S:-90}" --quiet > "$R/dask_run.txt" 2>&1
  echo "exit $?" >> "$R/dask_run.txt"; tail -6 "$R/dask_run.txt"
  ;;
esac
tar czf "$OUT/results.tgz" -C "$R" .      # after every step: a later timeout loses nothing
done
log done
