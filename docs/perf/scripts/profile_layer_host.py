# cProfile of one layer forward + backward's host side (8B, TP = world), GPU held by a sleep so the host
# never waits: torchrun --nproc-per-node 2 .diag/profile_layer_host.py CONFIG...
import cProfile, functools, io, os, pstats, sys, time
import torch, torch.distributed as dist
from overlap_tp.config import OverlapConfig

rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
t = dist.get_world_size(); dev = torch.device("cuda", rank)
from megatron.core import parallel_state as ps
from overlap_tp.bench import layer as L
from overlap_tp.layers import set_default_overlap_config
ps.initialize_model_parallel(tensor_model_parallel_size=t)
set_default_overlap_config(OverlapConfig(method="off"))
tbl = L.configurations("cuda")
cfg = L.layer_config("l8b", t, "cuda", True)
rope = L.rotary_embedding(cfg, 8192, dev)
x = torch.randn(8192 // t, 1, 4096, device=dev, dtype=torch.bfloat16).requires_grad_(True)
g = torch.randn_like(x)
for name in sys.argv[1:]:
    kind, overlap, _ = tbl[name]
    layer = L.build_layer(kind, cfg, dev)
    L._apply_overlap(layer, overlap)
    run = functools.partial(L.step, layer, x, g, rope)
    for _ in range(3):
        run()
    walls = []
    pr = cProfile.Profile()
    for i in range(4):
        torch.cuda.synchronize(); dist.barrier()
        torch.cuda._sleep(int(2e8))   # ~100 ms
        t0 = time.perf_counter()
        if i:
            pr.enable()
        run()
        if i:
            pr.disable()
        walls.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    if rank == 0:
        print(f"== {name}: host ms per step (first unprofiled, then 3 profiled): {[round(w, 2) for w in walls]}")
        for key in ("tottime", "cumtime"):
            s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats(key).print_stats(45)
            print(f"-- by {key}"); print("\n".join(s.getvalue().splitlines()[4:55]), flush=True)
    del layer; torch.cuda.empty_cache()
ps.destroy_model_parallel(); dist.destroy_process_group()
