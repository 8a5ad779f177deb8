# sourced by the run scripts: environment, carried wheels, the package installed, cwd /tmp
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OVERLAP_TP_WATCHDOG_S=30
REPO=$PWD
# the commit benchmark records name: `COMMIT=<sha> bash <script>`, the sha written out on the calling machine (the
# device's copy of the tree carries git metadata that did not follow later commits in session 26: `git rev-parse`
# there named an older commit)
export OVERLAP_TP_GIT_COMMIT=${COMMIT:-${OVERLAP_TP_GIT_COMMIT:-unknown}}
rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | grep -v -i warn | tail -2
export PYTHONPATH=/tmp/site
python3 -m pip install --no-deps --no-build-isolation . -q 2>&1 | grep -v -i warning | tail -2
cd /tmp

# Helpers of the run scripts (session 11 on).
# workdir NAME: a fresh /tmp/NAME as $W, packed (without tensorboard folders) into $OUT/NAME.tgz at exit
workdir() {
  W=/tmp/$1; rm -rf "$W"; mkdir -p "$W"
  trap "cd '$W' && rm -rf */tensorboard && tar czf '$OUT/$1.tgz' ." EXIT
}
DEADLINE_S=${DEADLINE_S:-585}   # a step that could end past this many seconds of the call is skipped
fits() {   # fits NAME SECONDS: 0 if the step can end before DEADLINE_S, else says it is skipped
  if (( SECONDS + $2 > DEADLINE_S )); then echo "$1 skipped (time)"; return 1; fi
}
step() {   # step NAME SECONDS CMD...: CMD under a time limit, its output in $W/NAME.out, a summary printed;
           # 6 s before the limit every process of the step gets SIGABRT (PYTHONFAULTHANDLER=1: stacks in NAME.out)
  local name=$1 limit=$2; shift 2
  fits "$name" "$limit" || return 0
  setsid timeout -s KILL "$limit" "$@" > "$W/$name.out" 2>&1 &
  local pid=$! t0=$SECONDS   # setsid in a background job does not fork: $pid is the step's session
  while kill -0 $pid 2>/dev/null; do
    sleep 1
    if (( SECONDS - t0 > limit - 6 )); then
      echo "$name: at its time limit: SIGABRT to its processes (stacks in $name.out)"
      pkill -ABRT -s $pid; sleep 3; pkill -KILL -s $pid; break
    fi
  done
  wait $pid; echo "$name exit $? at ${SECONDS}s"
  grep -E "Error|error:|Traceback|passed|failed|soak:" "$W/$name.out" | head -5
}
train() {   # train NAME SECONDS ENV... -- RECIPE ARGS: a recipe in the background, OUT_DIR=$W/NAME, watched for
            # a hang at exit: 30 s after "after training is done" its workers get SIGABRT (with
            # PYTHONFAULTHANDLER=1 they print their stacks), then SIGKILL; likewise 8 s before its time limit
            # (a run cut by the limit leaves its workers' stacks: stuck or still compiling)
  local name=$1 limit=$2; shift 2
  fits "$name" "$limit" || return 0
  local envs=(); while [[ $1 != -- ]]; do envs+=("$1"); shift; done; shift
  local t0=$SECONDS
  env "${envs[@]}" OUT_DIR="$W/$name" setsid timeout -s KILL "$limit" bash "$@" > "$W/$name.out" 2>&1 &
  local pid=$! done_at=
  while kill -0 $pid 2>/dev/null; do
    sleep 1
    if [[ -z $done_at ]] && grep -q "after training is done" "$W/$name/train.log" 2>/dev/null; then done_at=$SECONDS; fi
    if [[ -n $done_at ]] && (( SECONDS - done_at > 30 )); then
      echo "$name: still alive 30 s after training ended: SIGABRT to its workers"
      pkill -ABRT -f "overlap_tp.launch.pretrain.*$W/$name"; sleep 4; pkill -KILL -f "$W/$name"; break
    fi
    if [[ -z $done_at ]] && (( SECONDS - t0 > limit - 8 )); then
      echo "$name: at its time limit before training ended: SIGABRT to its workers (stacks in $name.out)"
      pkill -ABRT -f "overlap_tp.launch.pretrain.*$W/$name"; sleep 4; pkill -KILL -f "$W/$name"; break
    fi
  done
  wait $pid; echo "$name exit $? after $((SECONDS - t0)) s (training ended at +$(( ${done_at:-$SECONDS} - t0 )) s)"
}
tests() {   # tests NAME SECONDS PYTEST-ARGS...: GPU tests as a step, their PASSED / FAILED / ERROR lines printed (session 39)
  local name=$1 limit=$2; shift 2
  step $name $limit python3 -m pytest -m gpu -v -rA --tb=short -p no:cacheprovider "$@"
  grep -E "^(PASSED|FAILED|ERROR)" $W/$name.out | cut -c1-160 | tail -14
}
