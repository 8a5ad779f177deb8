# Session 16, call 8 (ONE GPU): the plan calls' host time with the variants interleaved round by round (call 7's
# figures moved 2x within one run): plan, functional API, off, a bare cuBLAS call, and the plan through
# CompiledKernel.run (--ab), 30 rounds of 8-call bursts each.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s16_eight
step probe_host_t1 240 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_host_t1.py --ab
grep -E "^op=|memop" $W/probe_host_t1.out
