# The next session's second call (2 GPUs; ~6 min), written in session 24: what a resumed run's state differs in
# (issue 24). Session 24's control showed the resume drift without overlap_tp (--overlap-tp off, eager, deterministic,
# torch_dist: iteration 11 bitwise, later iterations ~1e-4 off), so it is Megatron's resume here; a helper's CPU round
# trip of Megatron's Float16 optimizer through a torch_dist checkpoint (one rank) restored every tensor and the next
# steps bit for bit. Here, on the smoke recipe (TP 2, eager, deterministic, overlap off), three short runs:
#   A: 11 iterations, checkpoints at 10 and 11;
#   C: loads A's 10, trains nothing, saves it again (save interval 7: the end-of-training save) -> a save/load
#      round trip at TP 2 on GPUs;
#   B: loads A's 10, trains iteration 11, saves at 11.
# compare_checkpoints.py names every tensor (model weights, fp32 main params, Adam moments) and common.pt entry that
# differs. C = A at 10 and B != A at 11: the state comes back whole and the first resumed update differs (a process's
# first iteration, or state outside the checkpoint); C != A at 10: the round trip loses what it names.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=560
workdir s25_2
export CUDA_VISIBLE_DEVICES=0,1
S="OVERLAP=off GRAPHS=none LOG_INTERVAL=1"
F="--no-overlap-tp-stats --deterministic-mode --ckpt-format torch_dist"
train ckpt-a 75 $S TRAIN_ITERS=11 -- $REPO/recipes/smoke.sh $F --save $W/ckA --save-interval 10
for c in B C; do
  mkdir -p $W/ck${c}_in && cp -r $W/ckA/iter_0000010 $W/ck${c}_in/ && echo 10 > $W/ck${c}_in/latest_checkpointed_iteration.txt
done
train ckpt-c 60 $S TRAIN_ITERS=10 -- $REPO/recipes/smoke.sh $F --load $W/ckC_in --save $W/ckC --save-interval 7 \
  --exit-on-missing-checkpoint
train ckpt-b 60 $S TRAIN_ITERS=11 -- $REPO/recipes/smoke.sh $F --load $W/ckB_in --save $W/ckB --save-interval 10 \
  --exit-on-missing-checkpoint
grep -hE " iteration +1[01]/" $W/ckpt-a/train.log $W/ckpt-b/train.log | sed -E 's/.*(iteration +[0-9]+).*(lm loss: [0-9.E+-]+).*(grad norm: [0-9.]+).*/\1 \2 \3/'
ls $W/ckA $W/ckB $W/ckC 2>&1 | tr '\n' ' '; echo
echo "== round trip: A's 10 against C's re-save"
python3 $REPO/docs/perf/scripts/compare_checkpoints.py $W/ckA/iter_0000010 $W/ckC/iter_0000010 2>&1 | grep -v Warning | head -40
echo "== first resumed update: A's 11 against B's"
python3 $REPO/docs/perf/scripts/compare_checkpoints.py $W/ckA/iter_0000011 $W/ckB/iter_0000011 2>&1 | grep -v Warning | head -60
# Issue 24's SIGSTOP case alone (overlap on: its watchdog ends the waiting rank), never reached in sessions 22-24
# behind the kill and resume runs
cd $REPO
step stall 160 env STALL=1 FORMATS= REFERENCE=0 FAULT_OVERLAP=signal GRAPHS=none COMMIT=${COMMIT:-unknown} \
  OUT=$W/stall WORK=/tmp/s25s SKIP_INSTALL=1 bash docs/perf/scripts/run_s10_faults.sh
cd /tmp
grep -E "^\| stall|failures" $W/stall/summary.md 2>/dev/null | cut -c1-400
# Issue 25: a mixtral-proxy signal run to its 20th iteration (run_s25_1's two were cut at 16-17 by a 70 s limit)
M="NUM_LAYERS=4 TRAIN_ITERS=20 GBS=4 LOG_INTERVAL=1"
train mixtral-signal-c 100 OVERLAP=signal $M -- $REPO/recipes/mixtral-proxy.sh
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 6 $W/mixtral-*/train.log | sed "s#$W/##" | tee $W/mixtral.md
