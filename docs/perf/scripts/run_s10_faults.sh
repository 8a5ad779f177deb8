#!/usr/bin/env bash
# Session 10 (nvidia-h200-x2): training under faults with --overlap-tp signal (issue 24, item 4), on the smoke
# recipe (recipes/smoke.sh: 4-layer Llama-style GPT, TP 2, sequence parallel, Megatron's mock data).
#
#   1. reference: TRAIN_ITERS (30) iterations, uninterrupted, no checkpoint.
#   2. per checkpoint format F in torch_dist and torch (Megatron's legacy format):
#      a. fault: the same run with --save every 10 iterations; once iteration KILL_AFTER (12) is logged, and
#         the checkpoint of iteration 10 is written, half a logged step time later SIGKILL the rank-1 worker
#         (LOCAL_RANK 1): mid-step. Expect torchrun to end the job with an error naming rank 1 and signal 9, within
#         OVERLAP_TP_WATCHDOG_S (WATCHDOG_S, 30) of the kill, and no process of the job left alive.
#      b. resume: --load the same folder (the checkpoint of iteration 10) and train to TRAIN_ITERS: the 20
#         following iterations must log the reference's losses and grad norms exactly (as printed).
#         The fault run's iterations 1-10 against the reference's say whether two uninterrupted runs agree
#         at all (a difference there is run-to-run nondeterminism, not a resume problem).
#   3. optional (STALL=1, ~1 min more): SIGSTOP rank 1 mid-step instead (a rank that hangs without dying;
#      torchrun sees nothing): rank 0's overlap_tp watchdog must end it with its message within
#      STALL_WATCHDOG_S (20) plus torchrun's shutdown. Needs the overlap on (FAULT_OVERLAP=off has no watchdog: NCCL's
#      own timeout would end it after minutes). `STALL=1 FORMATS= REFERENCE=0` runs this case alone.
#
# The recipe's own knobs pass through (e.g. GRAPHS=none for eager steps; its default is Megatron's full-iteration
# CUDA graphs). DETERMINISTIC=1 adds Megatron's --deterministic-mode: two uninterrupted runs of the default setup
# already differ (session 11: 2 of 10 iterations identical), so a bitwise resume can only be shown with it.
# Run from the repository root on the device: `COMMIT=<sha> bash docs/perf/scripts/run_s10_faults.sh`.
# Writes under $OUT: summary.md, reference.log, fault_<F>.log, resume_<F>.log (and stall.log; <job>_stuck.txt, the
# job's processes and their states, where a job outlived its limit: their stacks are then in <job>.log).
# Budget: about 3-4 minutes on 2 x H200 without STALL (each run ~30 s: start-up, Triton compiles, 30 steps).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown}
REPO=$PWD
OUT=${OUT:-/tmp/s10_out}
WORK=${WORK:-/tmp/s10}
TRAIN_ITERS=${TRAIN_ITERS:-30}
SAVE_EVERY=${SAVE_EVERY:-10}
KILL_AFTER=${KILL_AFTER:-12}
WATCHDOG_S=${WATCHDOG_S:-30}
STALL_WATCHDOG_S=${STALL_WATCHDOG_S:-20}
FORMATS=${FORMATS-"torch_dist torch"}   # set and empty (FORMATS=): no format runs
FAULT_OVERLAP=${FAULT_OVERLAP:-signal}   # off: the same faults and resume on Megatron's path (the control)
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-150}   # per training run: a hang must not eat the session's device time
mkdir -p "$OUT" "$WORK"
SUMMARY=$OUT/summary.md
FAILS=0

if [[ ${SKIP_INSTALL:-0} != 1 ]]; then
  rm -rf /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 \
    | grep -v -i warn | tail -2
  export PYTHONPATH=/tmp/site
  python3 -m pip install --no-deps --no-build-isolation . -q 2>&1 | grep -v -i warning | tail -2
fi
cd /tmp   # not the repository root: there `import overlap_tp` would find the source tree, not the installed package

note() { echo "$*" | tee -a "$SUMMARY"; }
now() { date +%s.%N; }

# Processes of one job: the recipe runs with S10_TAG=<job> in its environment, which torchrun and its workers
# inherit; this script's own environment does not have it.
tagged() {   # tagged JOB [VAR=VALUE]: pids whose environment holds S10_TAG=JOB (a regex; and VAR=VALUE)
  local pid env
  for env in /proc/[0-9]*/environ; do
    pid=${env#/proc/}; pid=${pid%/environ}
    [[ $pid == "$$" ]] && continue
    env=$({ tr '\0' '\n' < "$env"; } 2>/dev/null) || continue   # gone, or not ours to read
    grep -qxE "S10_TAG=$1" <<< "$env" || continue
    [[ -z ${2:-} ]] || grep -qx "$2" <<< "$env" || continue
    echo "$pid"
  done
}

worker() {   # worker JOB LOCAL_RANK: the training process of that rank (a python running overlap_tp.launch.pretrain)
  local pid
  for pid in $(tagged "$1" "LOCAL_RANK=$2"); do
    { tr '\0' ' ' < "/proc/$pid/cmdline"; } 2>/dev/null | grep -q "overlap_tp.launch.pretrain" && echo "$pid"
  done | head -1
}

wait_for() {   # wait_for LOG REGEX SECONDS PID: 0 once REGEX is in LOG; 1 on timeout or when PID has ended
  local deadline=$(( $(date +%s) + $3 ))
  while (( $(date +%s) < deadline )); do
    grep -qE "$2" "$1" 2>/dev/null && return 0
    kill -0 "$4" 2>/dev/null || return 1
    sleep 0.05
  done
  return 1
}

# train JOB WATCHDOG [megatron args...]: the smoke recipe in the background, log $WORK/JOB/train.log; sets JOB_PID
train() {
  local job=$1 watchdog=$2; shift 2
  rm -rf "${WORK:?}/$job"; mkdir -p "$WORK/$job"
  S10_TAG=$job OUT_DIR=$WORK/$job OVERLAP=$FAULT_OVERLAP TRAIN_ITERS=$TRAIN_ITERS LOG_INTERVAL=1 WANDB_PROJECT= \
    OVERLAP_TP_WATCHDOG_S=$watchdog PYTHONFAULTHANDLER=1 MASTER_PORT=$(( 29500 + RANDOM % 1000 )) \
    timeout -s KILL "$RUN_TIMEOUT_S" bash "$REPO/recipes/smoke.sh" --no-overlap-tp-stats \
    ${DETERMINISTIC:+--deterministic-mode} "$@" \
    > "$WORK/$job/recipe.out" 2>&1 &
  JOB_PID=$!
}

finish() {   # finish JOB: wait for the job (not in a subshell: it is this shell's child); RC = its exit status;
             # its log copied to $OUT/JOB.log
  wait "$JOB_PID"; RC=$?
  cp "$WORK/$1/train.log" "$OUT/$1.log" 2>/dev/null || cp "$WORK/$1/recipe.out" "$OUT/$1.log"
}

sweep() {   # end whatever any job of this script left running (after it was reported)
  local pid
  for pid in $(tagged '[^ ]*'); do kill -KILL "$pid" 2>/dev/null; done
}
trap sweep EXIT

left_alive() {   # left_alive JOB: the job's processes still running (zombies excluded)
  local pid
  for pid in $(tagged "$1"); do
    [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) =~ ^[^Z]$ ]] && echo "$pid"
  done | tr '\n' ' '
}

check_fault() {   # check_fault JOB T_KILL T_END RC WHAT MESSAGE_REGEX LIMIT_S: prints the table row; 1 if it failed
  local job=$1 t_kill=$2 t_end=$3 rc=$4 what=$5 regex=$6 limit=$7 elapsed alive clear ok=PASS
  elapsed=$(python3 -c "print(f'{$t_end - $t_kill:.1f}')")
  # stragglers get 10 s to go (a DataLoader worker notices its dead parent within 5 s); any left are named
  local waited=0
  alive=$(left_alive "$job")
  while [[ -n $alive ]] && (( waited < 10 )); do sleep 1; waited=$((waited + 1)); alive=$(left_alive "$job"); done
  [[ -z $alive ]] || alive=$(for pid in $alive; do
      printf '%s(%s) ' "$pid" "$({ tr '\0' ' ' < "/proc/$pid/cmdline"; } 2>/dev/null | cut -c1-80)"; done)
  clear=$(grep -E "$regex" "$OUT/$job.log" | head -3 | tr -s ' ' | cut -c1-160 | paste -sd ';' -)
  [[ $rc != 0 ]] || ok=FAIL
  [[ -n $clear ]] || ok=FAIL
  [[ -z $alive ]] || ok=FAIL
  python3 -c "import sys; sys.exit(0 if $elapsed <= $limit else 1)" || ok=FAIL
  echo "| $job | $what | exit $rc | ${elapsed} s (limit ${limit} s) | ${alive:-none} | ${clear:-NO MESSAGE} | $ok |"
  [[ $ok == PASS ]]
}

fault() {   # fault JOB SIGNAL LIMIT_S MESSAGE_REGEX: once iteration KILL_AFTER is logged, SIGNAL to rank 1 half a
            # step later (mid-step), wait for torchrun, add the row to FAULT_ROWS
  local job=$1 signal=$2 limit=$3 regex=$4 victim t_kill row pid
  if ! wait_for "$WORK/$job/train.log" " iteration +$KILL_AFTER/" 120 "$JOB_PID" \
      || { [[ $job == fault_* ]] && [[ ! -f $CKPT/latest_checkpointed_iteration.txt ]]; }; then
    finish "$job"
    FAULT_ROWS+=("| $job | - | exit $RC | - | - | iteration $KILL_AFTER (or the checkpoint) never came | FAIL |")
    FAILS=$((FAILS + 1))
    return
  fi
  victim=$(worker "$job" 1)
  if [[ -z $victim ]]; then
    kill -KILL "$JOB_PID"; finish "$job"
    FAULT_ROWS+=("| $job | - | - | - | - | no rank-1 worker found (S10_TAG=$job, LOCAL_RANK=1) | FAIL |")
    FAILS=$((FAILS + 1))
    return
  fi
  # half of the last logged step time: the signal lands inside iteration KILL_AFTER + 1
  sleep "$(grep -oE 'elapsed time per iteration \(ms\): [0-9.]+' "$WORK/$job/train.log" | tail -1 \
           | awk '{printf "%.3f", $NF / 2000}' | grep . || echo 0.08)"
  t_kill=$(now)
  kill "-$signal" "$victim"
  # wait for torchrun, but not past the limit by much: a job that does not end is the failure being
  # looked for, and must not eat the session's device time
  local deadline=$(( $(date +%s) + limit + 15 ))
  while kill -0 "$JOB_PID" 2>/dev/null && (( $(date +%s) < deadline )); do sleep 0.05; done
  local t_end; t_end=$(now)
  if kill -0 "$JOB_PID" 2>/dev/null; then
    # still running past the limit: what each process of the job is doing (state, kernel wait channel), then
    # SIGABRT, on which Python's faulthandler (PYTHONFAULTHANDLER=1) prints every thread's stack into the log
    for pid in $(tagged "$job"); do
      printf '%s | %s\n' "$(ps -o pid=,ppid=,stat=,wchan:24= -p "$pid" 2>/dev/null)" \
        "$({ tr '\0' ' ' < "/proc/$pid/cmdline"; } 2>/dev/null | cut -c1-160)"
    done > "$OUT/${job}_stuck.txt"
    for pid in $(tagged "$job"); do   # Python processes only: a `tee` killed first would lose their stacks
      { tr '\0' ' ' < "/proc/$pid/cmdline"; } 2>/dev/null | grep -qE "python|torchrun" && kill -ABRT "$pid" 2>/dev/null
    done
    sleep 3
    for pid in $(tagged "$job"); do kill -KILL "$pid" 2>/dev/null; done
  fi
  finish "$job"
  kill -KILL "$victim" 2>/dev/null   # a stopped process keeps torchrun's SIGTERM pending: never leave one behind
  row=$(check_fault "$job" "$t_kill" "$t_end" "$RC" "SIG$signal rank 1 (pid $victim) after iteration $KILL_AFTER" \
        "$regex" "$limit") || FAILS=$((FAILS + 1))
  FAULT_ROWS+=("$row")
  note "- $row"   # in the summary at once: a caller's time limit may end this script before its tables
}

{
  echo "# Faults and resume with --overlap-tp $FAULT_OVERLAP (smoke recipe, TP 2)"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'), commit ${COMMIT:-unknown}, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | xargs)"
  echo "- $(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' 2>&1),"\
       "megatron-core $(python3 -c 'import importlib.metadata as m; print(m.version("megatron-core"))' 2>&1)"
  echo "- TRAIN_ITERS=$TRAIN_ITERS, --save-interval $SAVE_EVERY, kill after iteration $KILL_AFTER is logged,"\
       "OVERLAP_TP_WATCHDOG_S=$WATCHDOG_S"
  echo
} > "$SUMMARY"
cat "$SUMMARY"

# 1. the uninterrupted reference (REFERENCE=0 skips it: for STALL=1 FORMATS= alone, which compares no losses)
if [[ ${REFERENCE:-1} == 1 ]]; then
  train reference "$WATCHDOG_S"
  finish reference
  note "- reference run: exit $RC, $(grep -cE ' iteration +[0-9]+/' "$OUT/reference.log") iterations logged"
  [[ $RC == 0 ]] || FAILS=$((FAILS + 1))
fi

FAULT_ROWS=()
LOSS_ROWS=()
for fmt in $FORMATS; do
  CKPT=$WORK/ckpt_$fmt
  rm -rf "$CKPT"
  # 2a. SIGKILL rank 1 mid-step, after the checkpoint of iteration SAVE_EVERY
  train "fault_$fmt" "$WATCHDOG_S" --save "$CKPT" --save-interval "$SAVE_EVERY" --ckpt-format "$fmt"
  fault "fault_$fmt" KILL "$WATCHDOG_S" 'exitcode *: -9|Signal 9|SIGKILL'
  note "- checkpoint left by fault_$fmt: iteration $(cat "$CKPT/latest_checkpointed_iteration.txt" 2>/dev/null || echo none)"
  # 2b. resume from it to TRAIN_ITERS
  # no --save: the resumed run is compared, not checkpointed again (saves cost device time)
  train "resume_$fmt" "$WATCHDOG_S" --load "$CKPT" --ckpt-format "$fmt" --exit-on-missing-checkpoint
  finish "resume_$fmt"
  note "- resume_$fmt: exit $RC"
  [[ $RC == 0 ]] || FAILS=$((FAILS + 1))
  # the resumed run's second iteration prints Megatron's mean of its first two losses (s10_losses.py says why)
  row=$(python3 "$REPO/docs/perf/scripts/s10_losses.py" "$OUT/reference.log" "$OUT/resume_$fmt.log" \
        --first $((SAVE_EVERY + 1)) --last "$TRAIN_ITERS" --mixed-loss $((SAVE_EVERY + 2)) \
        --label "resumed ($fmt) vs reference") || FAILS=$((FAILS + 1))
  LOSS_ROWS+=("$row")
  note "- $row"
  # not a pass/fail check: whether two uninterrupted runs agree at all before the checkpoint
  LOSS_ROWS+=("$(python3 "$REPO/docs/perf/scripts/s10_losses.py" "$OUT/reference.log" "$OUT/fault_$fmt.log" \
                 --first 1 --last "$SAVE_EVERY" --label "fault run ($fmt) before its checkpoint vs reference")")
done

# 3. optional: a rank that stops without dying
if [[ ${STALL:-0} == 1 ]]; then
  train stall "$STALL_WATCHDOG_S"
  # the watchdog's limit, plus torchrun's shutdown of the stopped rank (SIGTERM, then SIGKILL after its grace)
  fault stall STOP "$((STALL_WATCHDOG_S + 40))" 'overlap_tp watchdog'
fi

{
  echo
  echo "## The job ends: exit status, time from the fault to torchrun's exit, processes left, the message"
  echo
  echo "| job | fault | torchrun | time to exit | left alive | message (first lines matching) | verdict |"
  echo "|---|---|---|---|---|---|---|"
  printf '%s\n' "${FAULT_ROWS[@]}"
  echo
  echo "## Losses after resume (Megatron's printed lm loss and grad norm, per iteration)"
  echo
  python3 -c "import sys; sys.path.insert(0, '$REPO/docs/perf/scripts'); import s10_losses; print(s10_losses.HEADER)"
  printf '%s\n' "${LOSS_ROWS[@]}"
  echo
  echo "failures: $FAILS"
} >> "$SUMMARY"
cat "$SUMMARY"
echo "processes on the GPUs now: $(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2>/dev/null | paste -sd ';' -)"
exit $(( FAILS > 0 ))
