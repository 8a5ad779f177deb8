# run_s25_2's checkpoint part again, on its own (its first call's output was lost: the packed checkpoints made the
# call run past its limit; the rerun of C found a fresh machine). Issue 24: A 11 iterations (checkpoints at 10, 11);
# C loads A's 10 and re-saves it (the checkpoint's scheduler used as is: Megatron refuses TRAIN_ITERS=10 against a
# checkpoint of an 11-iteration run otherwise); B loads A's 10, trains 11, saves. Logs to $OUT, checkpoints not.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=280
W=/tmp/s25_2c; rm -rf $W; mkdir -p $W; export CUDA_VISIBLE_DEVICES=0,1
S="OVERLAP=off GRAPHS=none LOG_INTERVAL=1"
F="--no-overlap-tp-stats --deterministic-mode --ckpt-format torch_dist"
train ckpt-a 75 $S TRAIN_ITERS=11 -- $REPO/recipes/smoke.sh $F --save $W/ckA --save-interval 10
for c in B C; do
  mkdir -p $W/ck${c}_in && cp -r $W/ckA/iter_0000010 $W/ck${c}_in/ && echo 10 > $W/ck${c}_in/latest_checkpointed_iteration.txt
done
train ckpt-c 60 $S TRAIN_ITERS=10 -- $REPO/recipes/smoke.sh $F --load $W/ckC_in --save $W/ckC --save-interval 7 \
  --exit-on-missing-checkpoint --use-checkpoint-opt_param-scheduler
train ckpt-b 60 $S TRAIN_ITERS=11 -- $REPO/recipes/smoke.sh $F --load $W/ckB_in --save $W/ckB --save-interval 10 \
  --exit-on-missing-checkpoint
for r in a b c; do cp $W/ckpt-$r.out $OUT/; done
grep -hE " iteration +1[01]/" $W/ckpt-a/train.log $W/ckpt-b/train.log | sed -E 's/.*(iteration +[0-9]+).*(lm loss: [0-9.E+-]+).*(grad norm: [0-9.]+).*/\1 \2 \3/'
echo "== round trip: A's 10 against C's re-save"
python3 $REPO/docs/perf/scripts/compare_checkpoints.py $W/ckA/iter_0000010 $W/ckC/iter_0000010 2>&1 | grep -v Warning | cut -c1-300 | head -40
echo "== first resumed update: A's 11 against B's"
python3 $REPO/docs/perf/scripts/compare_checkpoints.py $W/ckA/iter_0000011 $W/ckB/iter_0000011 2>&1 | grep -v Warning | cut -c1-300 | head -60
