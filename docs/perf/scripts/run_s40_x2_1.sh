# Session 40, call 1 (2 GPUs, `nvidia-h200-x2`; ~3 min): `COMMIT=<sha> bash docs/perf/scripts/run_s40_x2_1.sh`
# (carry [".whl"]). Issue 20: where an eager gemm_rs p2p call's ~70 us of host time go, part by part, beside this
# host's floors (probe_host_parts.py); the AllGather+GEMM and GEMM+AllReduce plans with a cProfile of their calls.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s40_x2_1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
lscpu > $W/lscpu.txt 2>&1; nproc >> $W/lscpu.txt
step parts 120 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_host_parts.py --rounds 30
cat $W/parts.out | grep -v "^W1\|^\*\*\*\|OMP_NUM" | tail -30
step host_other 150 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_host_t1.py --rounds 10 \
  --only "ag p2p,ar nccl" --profile
grep -v "^W1\|^\*\*\*\|OMP_NUM" $W/host_other.out | cut -c1-400 | tail -60
