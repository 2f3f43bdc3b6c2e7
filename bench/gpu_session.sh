#!/usr/bin/env bash
# The GPU figures the open issues ask for, in priority order, each under its own time limit
# so that one call of a lent machine (at most 10 minutes) returns whatever finished.
#   bash bench/gpu_session.sh a [LOG_DIR]   kernels compiled and timed, step 3 at 13B, 34B (under
#                                          an H100's memory), 70B (~9 min)
#   bash bench/gpu_session.sh b [LOG_DIR]   ours beside TRL (GC on/off, profile), generation (~8.5 min)
#   bash bench/gpu_session.sh c [LOG_DIR]   70B PPO with a small critic (~5 min; GRPO is in a)
# LOG_DIR (default $OUT, else ./gpu-logs) gets one log per part and the 70B run's metrics.
# Packages the machine lacks may sit as wheels in .whl/ (installed onto PYTHONPATH), and
# ../shared may sit in .shared/ (linked beside the checkout). Prepared where pip can reach
# the registry (datasets 5.2 needs dill<0.4.2 and multiprocess<0.70.20; antlr has no wheel):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl hydra-core==1.3.2 omegaconf==2.3.0 \
#     datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pyarrow==24.0.0 trl==1.16.0
#   pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3
#   mkdir -p .shared && cp -r ../shared/data ../shared/tokenizers .shared/
set -u
part=${1:?part a, b or c}
case $part in a|b|c) ;; *) echo "part $part: choose a, b or c" >&2; exit 2 ;; esac
logs=${2:-${OUT:-gpu-logs}}
mkdir -p "$logs"
log="$logs/part-$part.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed" | tee -a "$log"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -d .shared ] && [ ! -e ../shared ] && ln -s "$PWD/.shared" ../shared
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# what every part needs, checked before minutes go into it
[ -e ../shared/data/hh-rlhf-harmless-base-test.jsonl.gz ] ||
  echo "## ../shared/data is missing: copy /work/shared/{data,tokenizers} into .shared/" | tee -a "$log"
if [ "$part" = b ]; then
  python3 -c "import trl, datasets" 2>&1 | tail -1 | sed 's/^/## trl: /' | tee -a "$log"
fi

step() {   # step SECONDS COMMAND...: run it under a limit, its output into the log
  local limit=$1; shift
  echo "## $(date -u +%T) timeout $limit $*" | tee -a "$log"
  # line-buffered: the last lines reach the log even when the whole call is cut off
  timeout "$limit" "$@" 2>&1 | grep --line-buffered -v "^\[transformers\]\|Writing model\|it/s\]" |
    tee -a "$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || echo "## exit $rc$([ "$rc" = 124 ] && echo ' (its time limit)')" | tee -a "$log"
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
  # the GPU checks: ~66 compiled kernel cases (the in-place quantized base, int64 row offsets
  # at 70B's sizes), bf16 attention and the ZeRO++ quantizer (last run 2026-11-26)
  step 120 python3 -m pytest -q -p no:cacheprovider tests/harness/kernel_checks.py \
    tests/harness/bf16_checks.py tests/harness/quantize_checks.py
  # 34B with the allocator capped below an 80 GB H100's memory (bench/capped.py); 13B first
  step 170 python3 bench/largest.py --presets llama-13b llama-34b --iterations 5 \
    --memory-gib 76 --out /tmp/largest
  save_runs /tmp/largest   # after each run: a call cut off later keeps these
  step 60 python3 bench/quantized_matmul.py --models llama-70b --rows 1 16   # decode vs tiled
  step 200 python3 bench/largest.py --presets llama-70b --iterations 5 --out /tmp/largest
  save_runs /tmp/largest
elif [ "$part" = c ]; then   # 70B PPO with a small critic (70B GRPO is part a's)
  step 300 python3 bench/largest.py --presets llama-70b --ppo-only --iterations 4 \
    --out /tmp/largest
  save_runs /tmp/largest
else
  step 300 python3 bench/peers.py --iterations 8 --warmup 2 --profile --out /tmp/peers
  for f in /tmp/peers/*/stderr.txt; do   # each system's own log (a failure's whole story)
    [ -e "$f" ] && tail -c 20000 "$f" > "$logs/peers-$(basename "$(dirname "$f")").txt"
  done
  cp /tmp/peers/ours-gc-off/step3/profile/ops.txt "$logs/ops-gc-off.txt" 2>/dev/null
  # batches 1 and 8 (the issue's); no row in 120 s at 1, 8, 32 on 2026-11-28
  step 200 python3 bench/generation.py --gpu --repeats 2 --gpu-batches 1,8
fi
echo "## $(date -u +%T) done" | tee -a "$log"
