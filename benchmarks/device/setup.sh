# Sourced by the device scripts, from the repository root: the environment every benchmark runs in (NVLink
# multicast off), the carried wheels (.whl/*.whl: megatron-core where the device has no index) in /tmp/site, this
# checkout installed, and the helpers below; leaves the shell in /tmp (so the installed package is the one imported).
#   COMMIT=<sha>  the commit the records name (the device's copy of the tree may carry stale git metadata)
#   OUT           where results go (default /tmp/out); DEADLINE_S: a step that would end later is skipped
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 WANDB_PROJECT=
export OVERLAP_TP_WATCHDOG_S=${OVERLAP_TP_WATCHDOG_S:-30}
export OVERLAP_TP_GIT_COMMIT=${COMMIT:-${OVERLAP_TP_GIT_COMMIT:-unknown}}
REPO=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEADLINE_S=${DEADLINE_S:-585}
if compgen -G ".whl/*.whl" > /dev/null; then
  rm -rf /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 | grep -vi warn | tail -2
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation . 2>&1 | grep -vi warn | tail -2
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/cards.txt"
cd /tmp

workdir() {   # workdir NAME: a fresh /tmp/NAME as $W, packed (without tensorboard folders) into $OUT/NAME.tgz at exit
  W=/tmp/$1; rm -rf "$W"; mkdir -p "$W"
  trap "cd '$W' && rm -rf */tensorboard && tar czf '$OUT/$1.tgz' ." EXIT
}
fits() {   # fits NAME SECONDS: 0 if the step can end before DEADLINE_S, else says it is skipped
  if (( SECONDS + $2 > DEADLINE_S )); then echo "$1 skipped (time)"; return 1; fi
}
step() {   # step NAME SECONDS CMD...: CMD under a time limit, its output in $W/NAME.out; 6 s before the limit its
           # processes get SIGABRT (PYTHONFAULTHANDLER: their stacks in NAME.out)
  local name=$1 limit=$2; shift 2
  fits "$name" "$limit" || return 0
  setsid timeout -s KILL "$limit" "$@" > "$W/$name.out" 2>&1 &
  local pid=$! t0=$SECONDS
  while kill -0 $pid 2>/dev/null; do
    sleep 1
    if (( SECONDS - t0 > limit - 6 )); then
      echo "$name: at its time limit: SIGABRT (stacks in $name.out)"
      pkill -ABRT -s $pid; sleep 3; pkill -KILL -s $pid; break
    fi
  done
  wait $pid; echo "$name exit $? at ${SECONDS}s"
  grep -E "Error|error:|Traceback|passed|failed" "$W/$name.out" | head -5
}
train() {   # train NAME SECONDS VAR=VALUE... -- RECIPE ARGS: a recipe with OUT_DIR=$W/NAME; its workers get SIGABRT,
            # then SIGKILL, 30 s after "after training is done" (a hang at exit) or 8 s before the limit
  local name=$1 limit=$2; shift 2
  fits "$name" "$limit" || return 0
  local envs=(); while [[ $1 != -- ]]; do envs+=("$1"); shift; done; shift
  local t0=$SECONDS done_at=
  env "${envs[@]}" OUT_DIR="$W/$name" setsid timeout -s KILL "$limit" bash "$@" > "$W/$name.out" 2>&1 &
  local pid=$!
  while kill -0 $pid 2>/dev/null; do
    sleep 1
    if [[ -z $done_at ]] && grep -q "after training is done" "$W/$name/train.log" 2>/dev/null; then done_at=$SECONDS; fi
    local why=
    if [[ -n $done_at ]] && (( SECONDS - done_at > 30 )); then why="still alive 30 s after training ended"; fi
    if [[ -z $done_at ]] && (( SECONDS - t0 > limit - 8 )); then why="at its time limit before training ended"; fi
    if [[ -n $why ]]; then
      echo "$name: $why: SIGABRT to its workers (stacks in $name.out)"
      pkill -ABRT -f "overlap_tp.launch.pretrain.*$W/$name"; sleep 4; pkill -KILL -f "$W/$name"; break
    fi
  done
  wait $pid; echo "$name exit $? after $((SECONDS - t0)) s"
}
tests() {   # tests NAME SECONDS PYTEST-ARGS...: GPU tests as a step, their PASSED / FAILED / ERROR lines printed
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" python3 -m pytest -m gpu -v -rA --tb=short -p no:cacheprovider "$@"
  grep -E "^(PASSED|FAILED|ERROR)" "$W/$name.out" | cut -c1-160 | tail -14
}
