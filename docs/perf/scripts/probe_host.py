# Host cost probe: per-call Python/launch time of the overlapped ops and their pieces while the GPU is
# held busy (a sleep kernel ahead of them), cProfile of the signaled calls, and one layer's host vs GPU
# time. torchrun --nproc-per-node T .diag/probe_host.py [--layer-only]
import cProfile, functools, io, os, pstats, statistics, sys, time
import torch, torch.distributed as dist
from overlap_tp import OverlapConfig, ag_gemm, gemm_rs, comm
from overlap_tp import ops as O
from overlap_tp.kernels.signaled_gemm import signaled_gemm
from triton.tools.tensor_descriptor import TensorDescriptor

rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank)); G = dist.group.WORLD
t = dist.get_world_size(); dev = torch.device("cuda", rank)
SLEEP = int(3e8)   # ~150 ms of GPU time ahead of the measured calls


def say(*a):
    if rank == 0:
        print(*a, flush=True)


def host_us(fn, n=20, rounds=5):
    vals = []
    for _ in range(rounds):
        torch.cuda.synchronize(); dist.barrier()
        torch.cuda._sleep(SLEEP)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        vals.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(vals)


def prof(name, fn, n=100):
    for _ in range(5):
        fn()
    torch.cuda.synchronize(); dist.barrier()
    torch.cuda._sleep(SLEEP)
    pr = cProfile.Profile(); pr.enable()
    for _ in range(n):
        fn()
    pr.disable(); torch.cuda.synchronize()
    if rank == 0:
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
        print(f"== cProfile {name} ({n} calls)"); print("\n".join(s.getvalue().splitlines()[4:32]), flush=True)


def ops_probe():
    M, K, N = 4096, 4096 // t, 4096           # l8b.proj.s4096 at TP t
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 45
    shard = torch.randn(M // t, 4096, device=dev, dtype=torch.bfloat16)
    wq = torch.randn(3072 * 2 // t, 4096, device=dev, dtype=torch.bfloat16) / 64   # l8b.qkv
    cfgs = {"off": OverlapConfig(method="off"), "signal": OverlapConfig(method="signal"),
            "signal_g2_sm0": OverlapConfig(method="signal", groups=2, comm_sms=0),
            "p2p": OverlapConfig(method="signal", transport="p2p", comm_sms=0),
            "decompose": OverlapConfig(method="decompose", chunks=4)}
    rows = {}
    rows["bare matmul a@w.t()"] = host_us(lambda: a @ w.t())
    for name, c in cfgs.items():
        rows[f"gemm_rs {name}"] = host_us(lambda c=c: gemm_rs(a, w, G, config=c))
    rows["gemm_rs signal (undecorated)"] = host_us(lambda: gemm_rs.__wrapped__(a, w, G, config=cfgs["signal"]))
    for name in ("off", "signal", "p2p", "decompose"):
        rows[f"ag_gemm {name}"] = host_us(lambda c=cfgs[name]: ag_gemm(shard, wq, G, config=c))
    # pieces of the signaled gemm_rs
    c = cfgs["signal"]
    state = O.plan_state(c.schedule, M, N, t, c, 2, dev)
    staging = torch.empty(state.plan.staging_shape, dtype=a.dtype, device=dev)
    progs = O.gemm_programs(dev, c)
    rows["signaled_gemm launch (no wait)"] = host_us(lambda: signaled_gemm(a, w, staging, state.tiles, state.counters, progs, c))
    rows["TensorDescriptor.from_tensor"] = host_us(lambda: TensorDescriptor.from_tensor(a, [128, 64]))
    coll = comm.collectives(G, dev, 16)
    out = torch.empty(M // t, N, dtype=a.dtype, device=dev)
    rows["raw ncclReduceScatter"] = host_us(lambda: coll.reduce_scatter(out, staging.view(-1, N)[:M]))
    eng = comm.comm_engine(dev)
    zero = torch.zeros(4, dtype=torch.int32, device=dev)
    rows["cuStreamWaitValue32"] = host_us(lambda: eng.wait_counter(zero, 0, 0))
    rows["Event() + record"] = host_us(lambda: torch.cuda.Event().record())
    ev = torch.cuda.Event(); ev.record()
    rows["watchdog.watch"] = host_us(lambda: eng.watch(ev, "x"))

    def ctx():
        with torch.cuda.stream(eng.stream):
            pass
    rows["with torch.cuda.stream"] = host_us(ctx)
    rows["prepare()"] = host_us(lambda: O.prepare("gemm_rs", a, w, None, G, c, True))
    rows["plan_state lookup"] = host_us(lambda: O.plan_state(c.schedule, M, N, t, c, 2, dev))
    cur = torch.cuda.current_stream()
    rows["wait_event + wait_stream"] = host_us(lambda: (cur.wait_event(ev), eng.stream.wait_stream(cur)))
    rows["torch.empty staging"] = host_us(lambda: torch.empty(state.plan.staging_shape, dtype=a.dtype, device=dev))
    rows["gemm_programs()"] = host_us(lambda: O.gemm_programs(dev, c))
    rows["torch.cuda.current_stream(dev)"] = host_us(lambda: torch.cuda.current_stream(dev))
    rows["raw current stream handle"] = host_us(lambda: torch._C._cuda_getCurrentRawStream(rank))
    rows["resolve_method()"] = host_us(lambda: O.resolve_method(c, a, w, M // t, N, "gemm_rs"))
    say(f"## host us per call, t={t}, l8b.proj.s4096 / l8b.qkv.s4096")
    for k, v in rows.items():
        say(f"| {k} | {v:.1f} |")
    prof("gemm_rs signal", lambda: gemm_rs(a, w, G, config=cfgs["signal"]))
    prof("gemm_rs p2p", lambda: gemm_rs(a, w, G, config=cfgs["p2p"]))
    prof("ag_gemm p2p", lambda: ag_gemm(shard, wq, G, config=cfgs["p2p"]))
    prof("ag_gemm signal", lambda: ag_gemm(shard, wq, G, config=cfgs["signal"]))


def layer_probe():
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
    say(f"## layer l8b t={t}: GPU ms (events, median 10) | host ms (GPU held busy) ")
    for name in ("megatron", "off", "signal", "signal-p2p"):
        kind, overlap, _ = tbl[name]
        layer = L.build_layer(kind, cfg, dev)
        L._apply_overlap(layer, overlap)
        run = functools.partial(L.step, layer, x, g, rope)
        gpu = L.timed(lambda *_: run(), [()], 10, G, warmup=3)
        host = host_us(run, n=3, rounds=3) / 1e3
        say(f"| {name} | {gpu:.3f} | {host:.3f} |")
        if name == "signal":
            prof("layer signal fwd+bwd", run, n=5)
        del layer
        torch.cuda.empty_cache()
    ps.destroy_model_parallel()


if "--layer-only" not in sys.argv:
    ops_probe()
if "--ops-only" not in sys.argv:
    layer_probe()
dist.destroy_process_group()
