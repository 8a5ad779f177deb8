# Ops, layers, kernels: COMMIT=<sha> bash benchmarks/device/bench.sh KIND NPROC [ARGS...]
# python -m overlap_tp.bench KIND (ops, layer, gemm, norm, moe, moe_layer; `--help` for each) on NPROC GPUs, its
# report (.md with the command, commit, device and versions in its header, and .json) in $OUT as KIND_tNPROC unless
# ARGS name another (--out, --name). Examples:
#   bash benchmarks/device/bench.sh ops 2 --graphs --ops rs --seq 8192 --reps 30
#   bash benchmarks/device/bench.sh layer 4 --graphs --models l8b,l70b --seq 8192 --configs megatron,nocomm,signal-p2p-inplace-dw
#   NCCL_P2P_DISABLE=1 bash benchmarks/device/bench.sh moe_layer 2 --tokens 8192 --routing zipf,uniform   (cross-node proxy)
source "$(dirname "$0")/setup.sh"
kind=$1 nproc=$2; shift 2
if (( nproc == 1 )); then launch=(python3); else launch=(torchrun --nproc-per-node "$nproc"); fi
"${launch[@]}" -m overlap_tp.bench "$kind" --out "$OUT" --name "${kind}_t$nproc" "$@"
