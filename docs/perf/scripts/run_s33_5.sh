# Session 33's fifth call (4 GPUs, `nvidia-h200-x4`; ~1.5 min, the last device time): `COMMIT=<sha> bash
# docs/perf/scripts/run_s33_5.sh` (carry [".whl"]). Call 4: on l8b.qkv at t = 4 under graphs ours 0.310 ms, async-TP
# 0.216, finer chunks slower (g8 0.372). One replay of each profiled: the timeline of pulls against the GEMM.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-125}
workdir s33_5
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step ag_timeline 95 torchrun --nproc-per-node 4 $REPO/docs/perf/scripts/probe_ag_timeline.py --m 8192 --k 4096 --n 1536
grep -E "^## " $W/ag_timeline.out
