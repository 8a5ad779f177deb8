# Host cost of one signaled-GEMM launch and its pieces, on one GPU (no process group): the GPU is held by a
# sleep kernel so every figure is the host's enqueue time. python3 docs/perf/scripts/probe_launch.py
import cProfile, io, pstats, statistics, time
import torch
from triton.tools.tensor_descriptor import TensorDescriptor
from overlap_tp import OverlapConfig
from overlap_tp import ops as O
from overlap_tp.kernels import signaled_gemm as S

dev = torch.device("cuda", 0)
SLEEP = int(2e8)


def host_us(fn, n=50, rounds=7):
    vals = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        vals.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(vals)


M, K, N, t = 4096, 2048, 4096, 2          # l8b.proj.s4096 at TP 2 (gemm_rs's GEMM)
a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 45
c = OverlapConfig(method="signal")
state = O.plan_state(c.schedule, M, N, t, c, 2, dev)
staging = torch.empty(state.plan.staging_shape, dtype=a.dtype, device=dev)
progs = O.gemm_programs(dev, c)


def launch():
    S.signaled_gemm(a, w, staging, state.tiles, state.counters, progs, c)


launch()
torch.cuda.synchronize()
bm, bn, bk = c.block_m, c.block_n, c.block_k
a_desc, w_desc = TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk])
args = (a_desc, w_desc, staging, staging.stride(0), S._zero_offset(dev), staging, 0, 0, state.tiles,
        state.tiles.shape[0], state.counters, state.tiles, 0, N, K)
consts = dict(HAS_BIAS=False, SIGNAL=True, WAIT=False, INTERPRETED=False, W_KN=False, TILE_FIELDS=S.TILE_FIELDS,
              BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_PROGRAMS=progs, num_stages=c.num_stages, num_warps=c.num_warps)
kern = S.signaled_gemm_kernel[(progs,)](*args, **consts)   # returns the CompiledKernel
stream = torch.cuda.current_stream().cuda_stream
all_args = list(args) + [False, True, False, False, False, S.TILE_FIELDS, bm, bn, bk, progs]


def raw_run():
    kern.run(progs, 1, 1, stream, kern.function, kern.packed_metadata, None, None, None, *all_args)


fn = S.signaled_gemm_kernel
binder = fn.device_caches[0][4]
rows = {
    "signaled_gemm() (as the ops call it)": host_us(launch),
    "JIT launch with prebuilt descriptors": host_us(lambda: S.signaled_gemm_kernel[(progs,)](*args, **consts)),
    "CompiledKernel.run (no binder)": host_us(raw_run),
    "binder only": host_us(lambda: binder(*args, **consts)),
    "TensorDescriptor.from_tensor x2": host_us(lambda: (TensorDescriptor.from_tensor(a, [bm, bk]),
                                                       TensorDescriptor.from_tensor(w, [bn, bk]))),
    "torch.cuda.current_stream()": host_us(lambda: torch.cuda.current_stream()),
    "bare a @ w.t() (cuBLAS)": host_us(lambda: a @ w.t()),
}
for name, us in rows.items():
    print(f"{name:45s} {us:8.1f} us", flush=True)

torch.cuda.synchronize()
torch.cuda._sleep(SLEEP)
pr = cProfile.Profile()
pr.enable()
for _ in range(200):
    launch()
pr.disable()
torch.cuda.synchronize()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
print("\n".join(s.getvalue().splitlines()[:45]))
