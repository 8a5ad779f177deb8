# Session 7, call 5 (nvidia-h200-x4): llama3-8b and llama3-70b-proxy (TP 2) with --overlap-tp signal vs off,
# side by side on the two GPU pairs, at HEAD (the prefetching norm backward); logs kept (one tarball).
source .diag/setup_device.sh
export OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown}
W=/tmp/w7e; mkdir -p $W
pack() { cd $W && tar czf $OUT/s7_e.tgz . ; }
trap pack EXIT
pair() {  # recipe timeout_s signal_gpus off_gpus env...   (the pairs are swapped between recipes)
  local recipe=$1 limit=$2 sig_gpus=$3 off_gpus=$4; shift 4
  (env "$@" CUDA_VISIBLE_DEVICES=$sig_gpus OVERLAP=signal MASTER_PORT=29500 OUT_DIR=$W/$recipe-signal \
     timeout $limit bash $REPO/recipes/$recipe.sh > /dev/null 2>$W/$recipe-signal.err; echo "== $recipe signal exit $?") &
  (env "$@" CUDA_VISIBLE_DEVICES=$off_gpus OVERLAP=off MASTER_PORT=29600 OUT_DIR=$W/$recipe-off \
     timeout $limit bash $REPO/recipes/$recipe.sh > /dev/null 2>$W/$recipe-off.err; echo "== $recipe off exit $?") &
  wait
  for m in signal off; do
    local log=$W/$recipe-$m/train.log
    echo "-- $recipe $m"; tail -2 $W/$recipe-$m.err
    grep "\[overlap_tp\] layers on" $log | head -1
    grep -E " iteration +[0-9]+/" $log | tail -1 | tr '|' '\n' | grep -E "lm loss|elapsed|throughput"
    grep -iE "Error|Traceback" $log | head -3
  done
  python3 -m overlap_tp.report $W/$recipe-off/train.log $W/$recipe-signal/train.log --out $W/$recipe-report 2>&1 | tail -6
}
pair llama3-8b 220 0,1 2,3 TRAIN_ITERS=20 GBS=4 LOG_INTERVAL=2 WANDB_PROJECT=
pair llama3-70b-proxy 220 2,3 0,1 TRAIN_ITERS=20 GBS=4 LOG_INTERVAL=2 NUM_LAYERS=8 WANDB_PROJECT=
du -sh $W
