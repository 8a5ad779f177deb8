"""`python -m overlap_tp.bench SUBCOMMAND ...`: one entry point for every benchmark (`--help` lists them)."""
import importlib
import os
import sys

SUBCOMMANDS = {
    "ops": "overlap_tp.bench.ops",
    "norm": "overlap_tp.bench.norm",
    "gemm": "overlap_tp.bench.gemm",
    "layer": "overlap_tp.bench.layer",
    "moe": "overlap_tp.bench.moe",
    "moe_layer": "overlap_tp.bench.moe_layer",
    "te_gemm": "overlap_tp.bench.te_gemm",
}
DESCRIPTIONS = {   # one line each, for --help
    "ops": "GEMM+ReduceScatter, GEMM+AllReduce, AllGather+GEMM against cuBLAS + NCCL and async-TP (torchrun)",
    "norm": "the fused bias-dropout-add + RMSNorm kernels against torch's eager ops (one GPU)",
    "gemm": "the signaled GEMM alone against cuBLAS on the GEMMs the layers issue (one GPU)",
    "layer": "one TransformerLayer fwd+bwd: overlap_tp's against Megatron's and against no communication (torchrun)",
    "moe": "MoE a2a_gemm / gemm_a2a against all_to_all + cuBLAS (torchrun)",
    "moe_layer": "OverlapMoELayer against Megatron's MoELayer, fwd+bwd (torchrun)",
    "te_gemm": "the FP8 GEMM anchor: Transformer Engine's FP8 forward beside torch._scaled_mm and bf16 (one GPU)",
}


def usage():
    width = max(map(len, SUBCOMMANDS))
    lines = ["usage: python -m overlap_tp.bench SUBCOMMAND [ARGS...]   (SUBCOMMAND --help: its flags)", "",
             "subcommands:"]
    lines += [f"  {name:<{width}}  {DESCRIPTIONS[name]}" for name in SUBCOMMANDS]
    return "\n".join(lines)


# one rank per GPU under torchrun, at least this many ranks: the layer and MoE benchmarks also run on one GPU (TP 1,
# EP 1), where there is no communication and what they time is the overlapped path's own computation against
# Megatron's (or the sequential) path
DISTRIBUTED = {"ops": 2, "layer": 1, "moe": 1, "moe_layer": 1}


def requirement_problem(subcommand, argv, environ=os.environ, cuda_devices=None):
    """What this machine or launch lacks for `subcommand` (one line), or None. `cuda_devices`: the visible
    GPU count (default: torch's)."""
    if subcommand not in DISTRIBUTED or "--device" in argv and "cpu" in argv:
        return None   # norm and gemm check for their one GPU themselves; layer --device cpu needs none
    usage = f"torchrun --nproc-per-node 2 -m overlap_tp.bench {subcommand} ..."
    if "RANK" not in environ:
        return f"bench {subcommand} runs one rank per GPU under torchrun: {usage}"
    world = int(environ.get("WORLD_SIZE", "1"))
    if world < DISTRIBUTED[subcommand]:
        return (f"bench {subcommand} needs a group of {DISTRIBUTED[subcommand]} or more ranks (WORLD_SIZE is {world}): "
                f"{usage}")
    if cuda_devices is None:
        import torch
        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local = int(environ.get("LOCAL_WORLD_SIZE", world))
    if cuda_devices < local:
        return f"bench {subcommand}: {local} ranks on this node but {cuda_devices} visible CUDA GPU(s)"
    return None


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if not argv or argv[0] not in SUBCOMMANDS:
        unknown = f"python -m overlap_tp.bench: unknown subcommand {argv[0]!r}\n" if argv else ""
        print(unknown + usage(), file=sys.stderr)
        return 2
    if not any(flag in argv for flag in ("-h", "--help")):
        problem = requirement_problem(argv[0], argv[1:])
        if problem:
            print(problem, file=sys.stderr)
            return 2
    return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
