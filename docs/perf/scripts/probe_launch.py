# Host cost of one signaled-GEMM launch (and the sum kernel's) by launch path, on ONE GPU without a process group:
# the GPU is held by a sleep kernel so every figure is the host's enqueue time (median of rounds of 50 launches).
# The fused add + RMSNorm's kernels through Triton's JIT and through JitLauncher. GEMM paths: Triton's JIT
# (signaled_gemm()), CompiledKernel.run with TensorDescriptors and tensors (SignaledGemm before kernels/launch.py), the DirectKernel (SignaledGemm today), and the direct launch with a descriptor-cache
# miss on `a` every launch. Then the bits of each path compared (all must be equal) and a cProfile of the direct one.
#   python3 docs/perf/scripts/probe_launch.py
import cProfile, io, pstats, statistics, time
import torch
from overlap_tp import OverlapConfig
from overlap_tp.kernels import fused_add_rmsnorm as norm
from overlap_tp.kernels import signaled_gemm as S
from overlap_tp.kernels.sum_slots import SumSlots
from overlap_tp.ops.common import gemm_programs
from overlap_tp.ops.tile_plan import make_plan

dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
SLEEP = int(2e8)


def host_us(fn, n=50, rounds=9):
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


M, K, N = 8192, 2048, 4096          # l8b.proj at s 8192, TP 2 (gemm_rs's GEMM)
gen = torch.Generator(device=dev).manual_seed(0)
a = torch.randn(M, K, device=dev, generator=gen).bfloat16()
w = (torch.randn(N, K, device=dev, generator=gen) / 45).bfloat16()
w_kn = (torch.randn(K, N, device=dev, generator=gen) / 45).bfloat16()   # a dgrad's weight, read as w_kn.t()... [N, K]
bias = torch.randn(N, device=dev, generator=gen).bfloat16()
config = OverlapConfig(method="signal")
plan = make_plan(config.schedule, M, N, 1, config.block_m, config.block_n, config.groups, 2)
tiles = plan.tiles.to(dev)
counters = torch.zeros(plan.num_groups, dtype=torch.int32, device=dev)
progs = gemm_programs(dev, config)
dst = torch.empty(plan.staging_shape, dtype=torch.bfloat16, device=dev)
stream = torch.cuda.current_stream().cuda_stream

gemm = S.SignaledGemm(tiles, progs, config, counters=counters)
for _ in range(2):          # compile, then the variant's DirectKernel
    gemm(a, w, dst)
(kernel, grid, rest), = gemm._variants.values()
print(f"DirectKernel.direct = {kernel.direct}", flush=True)


def jit():
    S.signaled_gemm(a, w, dst, tiles, counters, progs, config)


def run_path():   # SignaledGemm before kernels/launch.py: the launch arguments rebuilt, CompiledKernel.run
    g, args, _ = gemm._launch_args(a, w, dst, None)
    kernel.compiled.run(g, 1, 1, torch._C._cuda_getCurrentRawStream(0), kernel.function, kernel.packed, None, None,
                        None, *args)


def direct():
    gemm(a, w, dst)


def direct_miss():
    kernel._descriptors.clear()
    gemm(a, w, dst)


gemm_kn = S.SignaledGemm(tiles, progs, config, counters=counters)
gemm_bias = S.SignaledGemm(tiles, progs, config, counters=counters, bias_rows=(0, M))
for _ in range(2):
    gemm_kn(a, w_kn.t(), dst)
    gemm_bias(a, w, dst, bias)
slots = torch.randn(2, M // 2, N, device=dev, generator=gen).bfloat16()
summed = torch.empty(M // 2, N, device=dev, dtype=torch.bfloat16)
sums = SumSlots(2, M // 2 * N)
for _ in range(2):
    sums(slots.view(2, -1), summed)
(sum_kernel,) = sums._compiled.values()


def sum_run():
    sum_kernel.compiled.run(sums.grid, 1, 1, torch._C._cuda_getCurrentRawStream(0), sum_kernel.function,
                            sum_kernel.packed, None, None, None, slots, summed, sums.numel, 2, 4096)


# the fused add + RMSNorm's launches (8B hidden, 4096 rows): through JitLauncher, and through the JIT itself
R, H = 4096, 4096
nx, nres = torch.randn(R, H, device=dev).bfloat16(), torch.randn(R, H, device=dev).bfloat16()
nw = torch.ones(H, device=dev).bfloat16()
nout = norm.empty_forward_outputs(nx, nres, torch.bfloat16)
nds, ndy = torch.empty_like(nres), torch.randn(R, H, device=dev).bfloat16()


def norm_forward():
    norm.launch_forward(nx, nres, nw, None, nout, eps=1e-5)


def norm_backward():
    norm.launch_backward(ndy, None, nout.residual_out, nout.rstd, nw, nds, None)


launchers = {name: getattr(norm, name) for name in ("_forward", "_backward", "_sum_partials")}


def through_jit(fn):
    def run():
        for name in launchers:
            setattr(norm, name, getattr(norm, name + "_kernel"))
        try:
            fn()
        finally:
            for name, launcher in launchers.items():
                setattr(norm, name, launcher)
    return run


for _ in range(2):
    norm_forward()
    norm_backward()

rows = {
    "fused add+RMSNorm forward: Triton JIT": host_us(through_jit(norm_forward)),
    "fused add+RMSNorm forward: JitLauncher": host_us(norm_forward),
    "its backward (2 kernels): Triton JIT": host_us(through_jit(norm_backward)),
    "its backward (2 kernels): JitLauncher": host_us(norm_backward),
    "signaled GEMM: Triton JIT (signaled_gemm())": host_us(jit),
    "signaled GEMM: args rebuilt + CompiledKernel.run (before)": host_us(run_path),
    "signaled GEMM: SignaledGemm direct (descriptors cached)": host_us(direct),
    "signaled GEMM: SignaledGemm direct, a's descriptor missed": host_us(direct_miss),
    "signaled GEMM: SignaledGemm direct, w read transposed": host_us(lambda: gemm_kn(a, w_kn.t(), dst)),
    "signaled GEMM: SignaledGemm direct, bias": host_us(lambda: gemm_bias(a, w, dst, bias)),
    "sum_slots: CompiledKernel.run with tensors (before)": host_us(sum_run),
    "sum_slots: SumSlots direct": host_us(lambda: sums(slots.view(2, -1), summed)),
    "bare a @ w.t() (cuBLAS)": host_us(lambda: a @ w.t()),
    "torch.empty(M, N)": host_us(lambda: torch.empty(M, N, device=dev, dtype=torch.bfloat16)),
}
for name, us in rows.items():
    print(f"{name:62s} {us:8.1f} us", flush=True)

# the bits: every path stores the same product (counters zeroed; their targets do not matter here)
outs = []
for fn in (jit, run_path, direct, direct_miss):
    dst.fill_(float("nan"))
    fn()
    outs.append(dst.clone())
print("paths bitwise equal:", all(torch.equal(outs[0], o) for o in outs[1:]),
      "| equals cuBLAS within bf16:", float(((outs[0].float() - (a @ w.t()).float()).norm()
                                             / (a @ w.t()).float().norm())), flush=True)

torch.cuda.synchronize()
torch.cuda._sleep(int(2e9))
pr = cProfile.Profile()
pr.enable()
for _ in range(200):
    direct()
pr.disable()
torch.cuda.synchronize()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
print("\n".join(s.getvalue().splitlines()[:30]))
