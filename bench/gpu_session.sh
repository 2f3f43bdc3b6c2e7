#!/usr/bin/env bash
# The GPU figures the open issues ask for, in priority order, each under its own time limit
# so that one call of a lent machine (at most 10 minutes) returns whatever finished.
#   bash bench/gpu_session.sh a [LOG_DIR]   kernels compiled and timed, step 3 at 13B, 34B (under
#                                          an H100's memory), 70B (~9 min)
#   bash bench/gpu_session.sh b [LOG_DIR]   ours beside TRL (GC on/off, profile), generation (~8.5 min)
#   bash bench/gpu_session.sh c [LOG_DIR]   70B GRPO, then PPO with a small critic (~7 min)
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

save_runs() {   # each largest.py run's metrics and log
  for run in "$1"/*-grpo "$1"/*-ppo; do
    [ -d "$run" ] || continue
    name=$(basename "$run")
    cp "$run/step3/metrics.jsonl" "$logs/metrics-$name.jsonl" 2>/dev/null
    tail -c 20000 "$run.log" > "$logs/train-$name.log" 2>/dev/null
  done
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
if [ "$part" = a ]; then
  step 110 python3 -m pytest -q -p no:cacheprovider tests/harness/kernel_checks.py   # ~55 compiled
  # 34B with the allocator capped below an 80 GB H100's memory (bench/capped.py); 13B first
  step 170 python3 bench/largest.py --presets llama-13b llama-34b --iterations 5 \
    --memory-gib 76 --out /tmp/largest
  step 60 python3 bench/quantized_matmul.py --models llama-70b --rows 1 16   # decode vs tiled
  step 200 python3 bench/largest.py --presets llama-70b --iterations 5 --out /tmp/largest
  save_runs /tmp/largest
elif [ "$part" = c ]; then   # 70B: GRPO, then PPO with a small critic
  step 400 python3 bench/largest.py --presets llama-70b --ppo --iterations 4 --out /tmp/largest
  save_runs /tmp/largest
else
  step 300 python3 bench/peers.py --iterations 8 --warmup 2 --profile --out /tmp/peers
  for f in /tmp/peers/*/stderr.txt; do   # each system's own log (a failure's whole story)
    [ -e "$f" ] && tail -c 20000 "$f" > "$logs/peers-$(basename "$(dirname "$f")").txt"
  done
  # batches 1 and 8 (the issue's); no row in 120 s at 1, 8, 32 on 2026-11-28
  step 200 python3 bench/generation.py --gpu --repeats 2 --gpu-batches 1,8
fi
echo "## $(date -u +%T) done" | tee -a "$log"
