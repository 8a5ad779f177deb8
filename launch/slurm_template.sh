#!/usr/bin/env bash
# Multi-node Megatron training with overlap_tp under SLURM: one torchrun per node, c10d rendezvous
# on the first node. Copy, adjust the #SBATCH lines, then: sbatch launch/slurm_template.sh [RECIPE]
# RECIPE is a file in recipes/ (default llama3-8b); its environment knobs (OVERLAP, TP, GBS, ...)
# pass through. Extra Megatron flags: MEGATRON_ARGS="--foo 1" sbatch ...
#SBATCH --job-name=overlap_tp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --time=01:00:00
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

RECIPE=${1:-llama3-8b}
REPO=${REPO:-$SLURM_SUBMIT_DIR}
export GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
export MASTER_PORT=${MASTER_PORT:-29500}
export OUT_DIR=${OUT_DIR:-$REPO/runs/$RECIPE-${OVERLAP:-signal}-$SLURM_JOB_ID}
# Keep NVLink multicast off where the hosts forbid it (the recipes set these for the run too).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# export NCCL_SOCKET_IFNAME=... NCCL_IB_HCA=...   # site-specific network settings

# Each node runs the recipe's torchrun with the whole job's geometry; torchrun's c10d rendezvous
# (endpoint on the first node, id = the job id) assigns the node ranks. Set TP (e.g. TP=8: tensor
# parallelism within a node, data parallelism across nodes) in the environment of sbatch.
srun --kill-on-bad-exit=1 bash -c '
  export NNODES=$SLURM_NNODES NPROC=$GPUS_PER_NODE
  export RDZV_ENDPOINT=$MASTER_ADDR:$MASTER_PORT RDZV_ID=$SLURM_JOB_ID
  export OUT_DIR=$OUT_DIR/node$SLURM_NODEID
  cd "'"$REPO"'"
  exec bash recipes/'"$RECIPE"'.sh --distributed-timeout-minutes 30 ${MEGATRON_ARGS:-}
'
