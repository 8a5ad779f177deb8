# Session 16, call 6 (ONE GPU): where the rest of a plan call's host time goes after the direct launches: the plan
# calls at t = 1 with a cProfile per op in us per call (probe_host_t1.py --profile).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s16_six
step probe_host_t1 150 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_host_t1.py --profile
cat $W/probe_host_t1.out | grep -v "^$" | head -90
