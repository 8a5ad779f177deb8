# Session 30's last call (4 GPUs, `nvidia-h200-x4`, H100s acceptable; ~5 min of the session's last 7):
# `COMMIT=<sha> bash docs/perf/scripts/run_s30_5.sh` (carry [".whl"]). Gathering in place at t = 4, where it has
# never run: the llama3 recipes turn it on by default (GATHER_IN_PLACE=1), also at TP 4.
# 1. The GPU test of the layers written in place (two layers bit for bit the staged pair, signal and decompose) at
#    t = 4 (gpu_world: every GPU of the machine).
# 2. One 8B layer fwd + bwd under graphs at t = 4, s 8192: signal-p2p / decompose-p2p with and without. Predicted
#    (session 29): in place 1-2% faster per layer at t = 4 (the stage copies sit on a communication-bound path).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-270}
workdir s30_5
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step in_place_t4 95 python3 -m pytest -m gpu -v -rA --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_layers_gpu.py -k "norms_write_into_the_gathered_buffers"
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/in_place_t4.out | grep -v "^\.\./" | cut -c1-200 | tail -6
step layer_t4 150 torchrun --nproc-per-node 4 -m overlap_tp.bench layer --graphs --models l8b --seq 8192 \
  --configs megatron,nocomm,signal-p2p,signal-p2p-inplace,decompose-p2p,decompose-p2p-inplace --reps 16 --rounds 3 \
  --out $W --name layer_t4_inplace
grep -E "^\| l8b " $W/layer_t4_inplace.md | cut -c1-220
