"""`python -m overlap_tp.launch.env_check`: can this machine run overlap_tp's GPU paths?

Prints GPU count and names, peer access between every pair, NCCL and CUDA versions, whether CUDA
stream memory operations are reachable (the driver's _v2 entry points), whether NVLink multicast is disabled, and
the Megatron / Transformer Engine versions. Exits 1 when something the overlapped GPU ops need is missing.
"""
import importlib.metadata
import os
import sys

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main():
    import torch

    problems = []
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {version('triton')}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"GPUs: {count}")
    if count == 0:
        problems.append("no CUDA GPU: only the CPU reference paths can run")
    for i in range(count):
        major, minor = torch.cuda.get_device_capability(i)
        print(f"  cuda:{i} {torch.cuda.get_device_name(i)} (sm_{major}{minor})")
        if (major, minor) < (9, 0):
            problems.append(f"cuda:{i} lacks TMA (compute capability < 9.0): method='signal' cannot run")
    for i in range(count):
        peers = [j for j in range(count) if j != i and torch.cuda.can_device_access_peer(i, j)]
        print(f"  cuda:{i} peer access to {peers}")
    if count:
        print(f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    if count:
        try:
            from overlap_tp.ops import memops
            memops._driver()
            print("libcuda: stream memory operations (cuStreamWaitValue32_v2 / cuStreamWriteValue32_v2) available")
        except (OSError, AttributeError) as error:
            problems.append(f"the CUDA driver's stream memory operations are missing ({error}): the comm stream "
                            f"cannot wait on tile counters")
    for name, wanted in MULTICAST_OFF.items():
        value = os.environ.get(name)
        note = "" if value == wanted else f"  (set {name}={wanted} on hosts where NVLink multicast is forbidden)"
        print(f"{name}={value}{note}")
    print(f"megatron-core {version('megatron-core')}, transformer-engine {version('transformer-engine') or version('transformer_engine')}")
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
