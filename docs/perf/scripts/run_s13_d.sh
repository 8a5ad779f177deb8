# Session 13, call 5 (nvidia-h200-x2): a2a_gemm's signal path at EP 2 (probe_a2a_ep2.py: eager vs GPU-only vs
# host, and a profile), the one MoE op still slower than sequential over NVLink.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s13_d
step a2a 150 env OUT=$W torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_a2a_ep2.py
grep -vE "^W1|^\*\*\*|OMP_NUM" $W/a2a.out | head -80
