# After run_s25_2 (same warm machine, its /tmp/s25_2 checkpoints kept): the TP-2 save/load round trip that run_s25_2's
# C missed (Megatron refused TRAIN_ITERS=10 against the checkpoint's scheduler, 80 vs 88 samples): here the
# checkpoint's scheduler is used as is. Then A's 10 against C's re-save, and A's 11 against B's again.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=200
W=/tmp/s25_2; export CUDA_VISIBLE_DEVICES=0,1
S="OVERLAP=off GRAPHS=none LOG_INTERVAL=1"
F="--no-overlap-tp-stats --deterministic-mode --ckpt-format torch_dist"
rm -rf $W/ckC $W/ckpt-c
train ckpt-c 75 $S TRAIN_ITERS=10 -- $REPO/recipes/smoke.sh $F --load $W/ckC_in --save $W/ckC --save-interval 7 \
  --exit-on-missing-checkpoint --use-checkpoint-opt_param-scheduler
grep -E "Error|saved checkpoint" $W/ckpt-c.out | head -5
echo "== round trip: A's 10 against C's re-save"
python3 $REPO/docs/perf/scripts/compare_checkpoints.py $W/ckA/iter_0000010 $W/ckC/iter_0000010 2>&1 | grep -v Warning | head -40
echo "== first resumed update: A's 11 against B's"
python3 $REPO/docs/perf/scripts/compare_checkpoints.py $W/ckA/iter_0000011 $W/ckB/iter_0000011 2>&1 | grep -v Warning | head -12
