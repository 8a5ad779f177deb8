# The next session's first call (4 GPUs, `nvidia-h200-x4` with needs_h200: the 70B proxy's 16 layers need more than
# 78 GiB per card; ~10 min: the last run is skipped if the time runs out), written in session 31:
# `COMMIT=<sha> bash docs/perf/scripts/run_s32_1.sh` (carry [".whl"]).
# Settles session 31's open question (docs/perf/s31/README.md): at TP 4, 16 layers, 12 iterations, the 70B proxy's loss
# under signal parted from off's after iteration 1, inside a grad-norm spike. If off against off parts as far as off
# against signal, it is the training (chaos amplifying bf16 rounding); if only signal parts, it is ours.
#   0:   the direct check first: two 70B layers gathering in place against the staged pair, bit for bit, at t = 4
#        (test_gather_in_place_at_the_70b_layer_shape, signal: the recipe's TP >= 4 mode);
#   1-2: off, signal at the recipe's learning rate, 20 iterations (session 21's schedule length);
#   3-4: off, signal at a tenth of it (--lr 1.5e-5 --min-lr 1.5e-6, flags after the recipe win), where no spike is
#        expected and the two should agree to 3-4 digits through iteration 20, as the 8-layer runs did;
#   5:   off again at the recipe's rate, if the time allows: off against off.
# The speed figures come along (iterations 11-20): a second reading of session 31's 1.022x.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s32_1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
run70() {   # NAME LIMIT MODE [megatron flags]
  local name=$1 limit=$2 mode=$3; shift 3
  train $name $limit GRAPHS=local TP=4 NPROC=4 NUM_LAYERS=16 OVERLAP=$mode TRAIN_ITERS=20 GBS=4 LOG_INTERVAL=1 -- \
    $REPO/recipes/llama3-70b-proxy.sh "$@"
}
step inplace_70b_t4 110 python3 -m pytest -m gpu -v -rA --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_layers_gpu.py -k "70b_layer_shape and signal"
grep -E "PASSED|FAILED|passed|failed" $W/inplace_70b_t4.out | grep -v "^\.\./" | cut -c1-200 | tail -3
run70 l70b16-off-1 140 off   # the first run compiles the 70B shapes' kernels
run70 l70b16-signal-2 125 signal
run70 l70b16-lowlr-off-3 125 off --lr 1.5e-5 --min-lr 1.5e-6
run70 l70b16-lowlr-signal-4 125 signal --lr 1.5e-5 --min-lr 1.5e-6
run70 l70b16-off-5 125 off
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 10 $W/l70b16-*/train.log | sed "s#$W/##" | tee $W/l70b16_t4.md
for d in $W/l70b16-*/; do   # loss and grad norm at every iteration
  echo "$(basename $d): $(grep -h 'iteration .*lm loss' $d/train.log | \
    sed -E 's/.*iteration +([0-9]+).*lm loss: ([^ ]+).*grad norm: ([^ ]+).*/\1:\2:\3/' | tr '\n' ' ')"
done | tee $W/l70b16_losses.txt | cut -c1-400
grep -h -E "Error|error:|Traceback|OutOfMemory" $W/*/train.log | sort | uniq -c | head -8
