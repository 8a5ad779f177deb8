# Session 41, call 6 (2 GPUs, `nvidia-h200-x2`; ~2 min): `COMMIT=<sha> bash docs/perf/scripts/run_s41_x2_6.sh`
# (carry [".whl"]). Issue 20's figure at the session's code: `bench ops --host` for the three ops on the signaled p2p
# transport (--host-config p2p: gemm_ar's too) and for ours (gemm_ar on NCCL), l8b shapes, s 8192.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-280}
workdir s41_x2_6
step host_p2p 100 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --ops rs,ar,ag --shapes l8b.proj \
  --ag-shapes l8b.qkv --seq 8192 --ag-seq 8192 --ar-seq 8192 --host --host-config p2p --reps 20 --out $W \
  --name ops_host_p2p_t2
grep -E "^\|" $W/ops_host_p2p_t2.md | cut -c1-600
step host_ours 100 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --ops rs,ar,ag --shapes l8b.proj \
  --ag-shapes l8b.qkv --seq 8192 --ag-seq 8192 --ar-seq 8192 --host --reps 20 --out $W --name ops_host_t2
grep -E "^\|" $W/ops_host_t2.md | cut -c1-600
