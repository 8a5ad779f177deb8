# Session 16, call 2 (ONE GPU): where the rest of the host time goes. The plan calls at t = 1 profiled
# (probe_host_t1.py --profile), and a new routing's first signaled-GEMM launch split into its pieces
# (_launch_args, the specialization lookup, the JIT, the descriptors, the launch: probe_expert_host.py).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s16_two
step probe_host_t1 150 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_host_t1.py --profile
grep -E "^op=" $W/probe_host_t1.out
step probe_expert_host 150 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_expert_host.py
grep -B1 -A12 "a2a_gemm forward" $W/probe_expert_host.out | head -60; tail -1 $W/probe_expert_host.out
