# The next session's third call (2 GPUs; ~5 min), written in session 24: issue 22's high-communication proxy, not
# run in sessions 21-24. BENCHMARKS.md's mid-size layer (h 3072, FFN 8192, 24 heads / 8 KV, s 4096, TP 2, SP),
# one TransformerLayer forward + backward under graphs, interleaved rounds:
# - with NCCL slowed to ~21-23 GB/s (NCCL_P2P_DISABLE=1) and the NCCL transports only (the proxy: what a slow
#   interconnect makes of the communication's share; the p2p transports would bypass the slowdown);
# - at NVLink speed with the p2p configs too (the same layer where communication is a mid-size share).
# Prediction: under the proxy Megatron's layer spends ~2x its nocomm time on communication and `signal` hides half
# of it (t/megatron ~0.75); at NVLink speed signal-p2p sits at nocomm as on 8B (0.93-0.95 of Megatron's).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=470
workdir s25_3
export CUDA_VISIBLE_DEVICES=0,1
step mid_proxy 230 env NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models mid \
  --seq 4096 --configs megatron,nocomm,off,signal,decompose --reps 40 --rounds 6 --out $W --name layer_mid_proxy
grep -E "^\| mid " $W/layer_mid_proxy.md | cut -c1-200
step mid_nvlink 210 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models mid --seq 4096 \
  --configs megatron,nocomm,signal,signal-p2p,decompose-p2p --reps 40 --rounds 6 --out $W --name layer_mid_nvlink
grep -E "^\| mid " $W/layer_mid_nvlink.md | cut -c1-200
