#!/usr/bin/env bash
# The GPU figures the open issues ask for, in priority order, each under its own time limit
# so that one call of a lent machine (at most 10 minutes) returns whatever finished.
#   bash bench/gpu_session.sh a [LOG_DIR]   kernels compiled and timed, step 3 at 13B, 34B, 70B (~8.5 min)
#   bash bench/gpu_session.sh b [LOG_DIR]   ours beside TRL (GC on/off, profile), generation (~8.5 min)
# LOG_DIR (default $OUT, else ./gpu-logs) gets one log per part and the 70B run's metrics.
# Packages the machine lacks may sit as wheels in .whl/ (installed onto PYTHONPATH), and
# ../shared may sit in .shared/ (linked beside the checkout).
set -u
part=${1:?part a or b}
logs=${2:-${OUT:-gpu-logs}}
mkdir -p "$logs"
log="$logs/part-$part.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed" | tee -a "$log"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -d .shared ] && [ ! -e ../shared ] && ln -s "$PWD/.shared" ../shared
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

step() {   # step SECONDS COMMAND...: run it under a limit, its output into the log
  local limit=$1; shift
  echo "## $(date -u +%T) timeout $limit $*" | tee -a "$log"
  timeout "$limit" "$@" 2>&1 | grep -v "^\[transformers\]\|Writing model\|it/s\]" | tee -a "$log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
if [ "$part" = a ]; then
  step 110 python3 -m pytest -q -p no:cacheprovider tests/harness/kernel_checks.py   # ~55 compiled
  step 60 python3 bench/quantized_matmul.py --models llama-70b --rows 1 16   # decode vs tiled
  # the table of sizes (a row as each ends; llama-70b alone took 161 s on 2026-11-28)
  step 330 python3 bench/largest.py --presets llama-13b llama-34b llama-70b --iterations 5 \
    --out /tmp/largest
  for run in /tmp/largest/*-grpo; do   # each size's metrics and log
    name=$(basename "$run")
    cp "$run/step3/metrics.jsonl" "$logs/metrics-$name.jsonl" 2>/dev/null
    tail -c 20000 "$run.log" > "$logs/train-$name.log" 2>/dev/null
  done
else
  step 300 python3 bench/peers.py --iterations 8 --warmup 2 --profile --out /tmp/peers
  for f in /tmp/peers/*/stderr.txt; do   # each system's own log (a failure's whole story)
    [ -e "$f" ] && tail -c 20000 "$f" > "$logs/peers-$(basename "$(dirname "$f")").txt"
  done
  step 200 python3 bench/generation.py --gpu --repeats 2   # no row in 120 s on 2026-11-28
fi
echo "## $(date -u +%T) done" | tee -a "$log"
