# Session 31's second call (4 GPUs, `nvidia-h200-x4` with needs_h200; ~7 min), written in session 30:
# `COMMIT=<sha> bash docs/perf/scripts/run_s31_1.sh` (carry [".whl"]). The 70B proxy at TP 4 end to end with the
# recipe's new TP >= 4 default (signal, gathering in place), against off and against decompose in place, 16 layers,
# local graphs. Session 30's layer at t = 4: signal in place 0.955 of Megatron's, decompose in place 1.002, staged
# signal 0.964; session 21 end to end (staged): signal and decompose-p2p 1.009x of off. Predicted: signal in place
# 1.01-1.02x of off (the layer's 1% over staged signal, diluted by the embedding, output layer and optimizer).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s31_1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
for mode in signal decompose off signal; do
  i=$(( ${i:-0} + 1 ))
  train l70b16-t4-$mode-$i 120 GRAPHS=local TP=4 NPROC=4 NUM_LAYERS=16 OVERLAP=$mode TRAIN_ITERS=14 GBS=4 -- \
    $REPO/recipes/llama3-70b-proxy.sh
done
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 6 $W/l70b16-*/train.log | sed "s#$W/##" | tee $W/l70b16_t4.md
grep -h "gather-in-place\|\[recipe\]" $W/l70b16-t4-signal-1.out | head -3 | cut -c1-200
grep -h -E "Error|error:|Traceback|OutOfMemory" $W/*/train.log | sort | uniq -c | head -8
