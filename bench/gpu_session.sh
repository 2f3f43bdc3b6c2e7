#!/usr/bin/env bash
# The GPU figures the open issues ask for, in priority order, each under its own time limit
# so that one call of a lent machine (at most 10 minutes) returns whatever finished.
#   bash bench/gpu_session.sh a [LOG_DIR]   kernels compiled, the quantized matmul, llama-70b step 3 (~7 min)
#   bash bench/gpu_session.sh b [LOG_DIR]   ours beside TRL (GC on/off, profile), generation (~6 min)
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
  step 75 python3 -m pytest -q -p no:cacheprovider tests/harness/kernel_checks.py
  step 45 python3 bench/quantized_matmul.py
  step 290 python3 bench/largest.py --presets llama-70b --iterations 5 --out /tmp/largest
  cp /tmp/largest/llama-70b-grpo/step3/metrics.jsonl "$logs/metrics-llama-70b.jsonl" 2>/dev/null
  tail -c 20000 /tmp/largest/llama-70b-grpo.log > "$logs/train-llama-70b.log" 2>/dev/null
else
  step 280 python3 bench/peers.py --iterations 8 --warmup 2 --profile --out /tmp/peers
  for f in /tmp/peers/*/stderr.txt; do   # each system's own log (a failure's whole story)
    [ -e "$f" ] && tail -c 20000 "$f" > "$logs/peers-$(basename "$(dirname "$f")").txt"
  done
  step 120 python3 bench/generation.py --gpu --repeats 2
fi
echo "## $(date -u +%T) done" | tee -a "$log"
