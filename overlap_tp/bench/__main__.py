"""`python -m overlap_tp.bench SUBCOMMAND ...`: one entry point for every benchmark."""
import importlib
import sys

SUBCOMMANDS = {
    "ops": "overlap_tp.bench.ops",    # GEMM+RS / GEMM+AR against the BENCHMARKS.md baselines (torchrun)
    "norm": "overlap_tp.bench.norm",  # fused reorder + residual add + RMSNorm (one GPU)
    "gemm": "overlap_tp.bench.gemm",  # the signaled GEMM alone vs cuBLAS on the layers' GEMMs (one GPU)
    "layer": "overlap_tp.bench.layer",  # one TransformerLayer fwd+bwd: ours vs Megatron vs no-comm (torchrun)
    "moe": "overlap_tp.bench.moe",    # MoE a2a_gemm / gemm_a2a against all_to_all + cuBLAS (torchrun)
    "moe_layer": "overlap_tp.bench.moe_layer",  # OverlapMoELayer against Megatron's MoELayer (torchrun)
}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        print(f"usage: python -m overlap_tp.bench {{{','.join(SUBCOMMANDS)}}} [--help]", file=sys.stderr)
        return 2
    return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
