# The next session's third call (4 GPUs, right after run_s32_1.sh on the same machine; ~2 min), written in session 31:
# `COMMIT=<sha> bash docs/perf/scripts/run_s32_3.sh` (carry [".whl"]). probe_token_split_block.py: how much of the 8B
# attention block's transfers (the qkv AllGather's pulls and a copy-engine ReduceScatter's pushes) a token split by
# sequence (micro-batch 2) hides, eager and under a graph, at t = 4 and on two of the GPUs at t = 2, on Megatron's one
# hardware queue. Predicted at t = 4 under a graph: the sequential order exposes both halves' pulls and pushes
# (~4 x 0.2 ms); staggered leaves half A's pulls and half B's pushes (~2 x 0.2 ms): about half hidden.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s32_3
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step block_t4 90 torchrun --nproc-per-node 4 $REPO/docs/perf/scripts/probe_token_split_block.py
step block_t2 90 env CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_token_split_block.py
grep -h -E "^(t = |eager|graph|attention:)" $W/block_t*.out
