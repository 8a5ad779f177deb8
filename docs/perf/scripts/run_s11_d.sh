# Session 11, call 4 (nvidia-h200-x2): GPU tests of the merged graph-replay deadline waits and the p2p changes;
# end to end with the same graphs on both sides: the smoke recipe (full_iteration) off / signal (transport auto)
# / signal with transport p2p, and llama3-8b (8 layers, local graphs) off / signal p2p. Every training run is
# watched for a hang at exit (seen in call 3: the job logged its last iteration, then never ended): 30 s after
# "after training is done" the workers get SIGABRT (PYTHONFAULTHANDLER=1 prints their Python stacks).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s11_d
step gpu_graphs 150 python3 -m pytest -m gpu -x -q -rA $REPO/tests/gpu/test_graphs_gpu.py -p no:cacheprovider
step gpu_rs 70 python3 -m pytest -m gpu -x -q -rA $REPO/tests/gpu/test_gemm_rs_gpu.py -k "bias or s8192" -p no:cacheprovider
train smoke-off 75 GRAPHS=full_iteration OVERLAP=off TRAIN_ITERS=40 -- $REPO/recipes/smoke.sh
train smoke-auto 75 GRAPHS=full_iteration OVERLAP=signal TRAIN_ITERS=40 -- $REPO/recipes/smoke.sh
train smoke-p2p 75 GRAPHS=full_iteration OVERLAP=signal TRANSPORT=p2p TRAIN_ITERS=40 -- $REPO/recipes/smoke.sh
train l8b8-off 110 GRAPHS=local OVERLAP=off TRAIN_ITERS=25 GBS=4 -- $REPO/recipes/llama3-8b.sh --num-layers 8
train l8b8-p2p 110 GRAPHS=local OVERLAP=signal TRANSPORT=p2p TRAIN_ITERS=25 GBS=4 -- $REPO/recipes/llama3-8b.sh --num-layers 8
python3 $REPO/docs/perf/scripts/summarize_runs.py $W/smoke-*/train.log | tee $W/smoke_summary.md
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/l8b8-*/train.log | tee $W/l8b8_summary.md
grep -l "Fatal Python\|Current thread\|Thread 0x" $W/*.out | head; grep -A25 -m1 "Fatal Python error: Aborted" $W/smoke-auto.out | head -40
