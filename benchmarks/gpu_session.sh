#!/usr/bin/env bash
# One GPU session: install, evaluate every sdpa seed, check timing stability and the build
# cache, time the baselines, run the gpu-marked tests, then search for the time that is left.
# Usage (GPU machine, repo root): OUT=dir DEADLINE=seconds [EVALS=1|cuda|flash|0] [GPU_TESTS=1]
#   [PROFILE=1] [PROBLEMS="strided gqa ..."] [RUNS="strided gqa ..." RUN_S=60] [PROBE=1]
#   [EVAL_LIST=file] [SPIN_DEMO=1] [GPU_TEST_FILES="tests/..."] bash benchmarks/gpu_session.sh
# EVAL_LIST: one evaluation per line, "name <evoattn eval arguments>" (e.g. a seed with --set
# knob values); '#' lines are skipped. SPIN_DEMO=1 runs benchmarks/spin_demo.py first (the timer's
# spins side by side), PROBE=1 then benchmarks/wgmma_probe.py (with PROBE_ARGS, e.g. "--watchdog").
# The sdpa search gets whatever time is left before DEADLINE, less SEARCH_RESERVE_S (45); it
# resumes gpu_runs/default if present (carry gpu_runs/ between calls to continue a run, the
# script leaves it in $OUT/gpu_runs.tgz; SEARCH_ITERS caps its iterations, default 100).
# BEST_EVAL=1 re-checks the run's best afterwards against every SDPA backend.
set -u
export PYTHONUNBUFFERED=1
R=$OUT/res; mkdir -p "$R"
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python -m pip install --no-deps --no-build-isolation -e .
python -c "import click, rich, yaml, pytest" 2>/dev/null || { python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site; }
which python; python -c "import click, rich, yaml; print(\"deps ok\")"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$R/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" >> "$R/gpu.txt"
date -u >> "$R/gpu.txt"; cat "$R/gpu.txt"
export EVOATTN_CACHE=/tmp/evoattn-cache
ev() { local name=$1; shift; log "eval $name"; timeout 300 python -m evoattn.cli eval "$@" --json "$R/$name.json" > "$R/$name.txt" 2>&1; echo "exit $?" >> "$R/$name.txt"; tail -4 "$R/$name.txt"; }
if [ "${SPIN_DEMO:-0}" = 1 ]; then
  log "spin demo"; timeout 200 python benchmarks/spin_demo.py --json "$R/spin_demo.json" > "$R/spin_demo.txt" 2>&1; echo "exit $?" >> "$R/spin_demo.txt"; tail -8 "$R/spin_demo.txt"
fi
if [ "${PROBE:-0}" = 1 ]; then
  log "wgmma probe"; timeout 300 python benchmarks/wgmma_probe.py ${PROBE_ARGS:-} > "$R/wgmma_probe.txt" 2>&1; echo "exit $?" >> "$R/wgmma_probe.txt"; tail -30 "$R/wgmma_probe.txt"
fi
if [ -n "${EVAL_LIST:-}" ]; then
  while read -r name args; do
    case "$name" in ''|'#'*) continue ;; esac
    [[ "$name" =~ ^[A-Za-z0-9_.-]+$ ]] || { log "skipped: bad result name '$name'"; continue; }
    # shell-like quoting, but never evaluated: no expansion, no command separators
    mapfile -t a < <(python -c 'import shlex, sys; print(*shlex.split(sys.argv[1]), sep="\n")' "$args")
    ev "$name" "${a[@]}" < /dev/null
  done < "$EVAL_LIST"
fi
# EVALS=flash: the Triton seed twice (cold, then warm Triton cache: stability and cost);
# EVALS=cuda: that, the tensor-core and fused CUDA seeds and the baselines; EVALS=1: every seed.
if [ "${EVALS:-1}" != 0 ]; then
ev flash_triton seeds/sdpa/flash_triton.py --all-backends
ev flash_triton_2 seeds/sdpa/flash_triton.py
find "$EVOATTN_CACHE" -name "*.cubin" | wc -l | sed 's/^/triton kernels compiled: /' | tee -a "$R/gpu.txt"
fi
if [ "${EVALS:-1}" = 1 ] || [ "${EVALS:-1}" = cuda ]; then
ev mma_flash seeds/sdpa/mma_flash.cu
ev mma_flash_2 seeds/sdpa/mma_flash.cu
ev fused seeds/sdpa/fused.cu --reps 5 --warmup 2
log baseline; timeout 200 python -m evoattn.cli baseline --json "$R/baseline.json" > "$R/baseline.txt" 2>&1; tail -3 "$R/baseline.txt"
fi
if [ "${EVALS:-1}" = 1 ]; then
ev naive_cu seeds/sdpa/naive.cu --reps 3 --warmup 1
ev naive_torch seeds/sdpa/naive_torch.py --reps 5 --warmup 2
ev ext_naive seeds/sdpa/ext_naive.cu --reps 5 --warmup 2 --configs "2,32,2048,64;1,8,512,64"
fi
if [ "${PROFILE:-0}" = 1 ]; then    # where one evaluation's time goes (warm Triton cache)
  log profile; timeout 180 python benchmarks/profile_eval.py seeds/sdpa/flash_triton.py --top 45 > "$R/profile.txt" 2>&1; head -3 "$R/profile.txt"
fi
if [ -n "${PROBLEMS:-}" ]; then     # PROBLEMS="strided gqa ...": each problem's seeds, fewer reps
  for p in $PROBLEMS; do for f in seeds/$p/*; do
    ev "${p}_$(basename $f .py)" "$f" --problem "$p" --reps 10 --warmup 3 --trials 2
  done; done
fi
if [ "${GPU_TESTS:-0}" = 1 ]; then
  log "gpu tests"; timeout ${GPU_TESTS_S:-300} python -m pytest -m gpu -q -p no:cacheprovider ${GPU_TEST_FILES:-tests/test_adversarial.py tests/test_build.py tests/test_wgmma_gpu.py tests/test_seeds_gpu.py} > "$R/gpu_tests.txt" 2>&1; tail -5 "$R/gpu_tests.txt"
fi
if [ -n "${RUNS:-}" ]; then         # RUNS="strided gqa ...": a short offline search per problem
  for p in $RUNS; do
    log "run $p for ${RUN_S:-60}s"
    timeout $(( ${RUN_S:-60} + 60 )) python -m evoattn.cli run --config configs/$p.yaml \
      --iterations ${RUN_ITERS:-100} --max-wall-s ${RUN_S:-60} --output gpu_runs/$p --quiet \
      > "$R/run_$p.txt" 2>&1; echo "exit $?" >> "$R/run_$p.txt"; tail -12 "$R/run_$p.txt"
    [ -f gpu_runs/$p/best/best_eval.json ] && cp gpu_runs/$p/best/best_eval.json "$R/run_${p}_best.json"
  done
fi
SEARCH_S=$(( ${DEADLINE:-0} - ($(date +%s) - T0) - ${SEARCH_RESERVE_S:-45} ))
if [ "$SEARCH_S" -gt 30 ]; then
  log "search for ${SEARCH_S}s"
  timeout $(( SEARCH_S + 30 )) python -m evoattn.cli run --config configs/default.yaml --iterations ${SEARCH_ITERS:-100} --max-wall-s $SEARCH_S \
     --output gpu_runs/default --quiet > "$R/run.txt" 2>&1
  echo "exit $?" >> "$R/run.txt"; tail -25 "$R/run.txt"
  cp gpu_runs/default/run.sqlite "$OUT/run.sqlite" 2>/dev/null
  cp gpu_runs/default/run.sqlite-wal "$OUT/run.sqlite-wal" 2>/dev/null
  cp gpu_runs/default/events.jsonl "$R/events.jsonl" 2>/dev/null
  [ -d gpu_runs/default/best ] && cp -r gpu_runs/default/best "$R/best"
  if [ "${BEST_EVAL:-0}" = 1 ] && [ -f gpu_runs/default/best/best.py ]; then   # re-check, every backend
    ev best_all_backends gpu_runs/default/best/best.py --all-backends
  fi
fi
tar -czf "$OUT/results.tgz" -C "$OUT" res
[ -d gpu_runs ] && tar -czf "$OUT/gpu_runs.tgz" --exclude='*/best' gpu_runs   # carry it back to resume
log done
