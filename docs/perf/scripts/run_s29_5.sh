# Session 29's fourth call (2 GPUs; ~8.5 min): `COMMIT=<sha> bash docs/perf/scripts/run_s29_5.sh` (carry [".whl"]).
# Issue 21 / 22: `--overlap-tp-gather-in-place` at the 70B proxy (8 layers, TP 2, local graphs both sides), beside
# the recipe's default (decompose) and off. Session 20: off 1964.5, decompose-p2p 1911.3 ms (1.028x). Predicted:
# in place removes the two stage copies per layer of 64 MB gathered (2 x ~0.16 ms fwd, the re-gathers beside the dgrad
# GEMMs in the backward) for 8 layers x 4 micro-batches: ~5-8 ms per step, ~1.031-1.032x.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s29_5
export CUDA_VISIBLE_DEVICES=0,1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
train l70b8-decompose 125 GRAPHS=local OVERLAP=decompose TRAIN_ITERS=16 GBS=4 -- $REPO/recipes/llama3-70b-proxy.sh
train l70b8-decompose-inplace 125 GRAPHS=local OVERLAP=decompose TRAIN_ITERS=16 GBS=4 -- \
  $REPO/recipes/llama3-70b-proxy.sh --overlap-tp-gather-in-place
train l70b8-off 125 GRAPHS=local OVERLAP=off TRAIN_ITERS=16 GBS=4 -- $REPO/recipes/llama3-70b-proxy.sh
train l70b8-signal-inplace 125 GRAPHS=local OVERLAP=signal TRAIN_ITERS=16 GBS=4 -- \
  $REPO/recipes/llama3-70b-proxy.sh --overlap-tp-gather-in-place
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 6 $W/l70b8-*/train.log | sed "s#$W/##" | tee $W/l70b8.md
grep -h -E "Error|error:|Traceback|OutOfMemory|own gathered" $W/*/train.log | sort | uniq -c | head -8
grep -h "max allocated\|memory (MB)" $W/*/train.log | head -8 | cut -c1-200
