"""GEMM+ReduceScatter and GEMM+AllReduce: the public ops and their four methods.

    gemm_rs(a[M, K_local], w[N, K_local]) -> [M/t, N] = reduce_scatter(a @ w.T) along dim 0
    gemm_ar(a[M, K_local], w[N, K_local]) -> [M, N]   = all_reduce(a @ w.T)

Methods (OverlapConfig.method): `signal` (persistent Triton GEMM + per-group collectives on the comm
stream), `decompose` (M-chunked cuBLAS + chunked collectives on the comm stream), both through a raw
NCCL communicator (overlap_tp/ops/nccl.py); `off` (cuBLAS then torch.distributed's collective: Megatron's
path); `auto` (the tuner's choice per shape, `tuned_config`). `off` is also the pure-torch reference: on CPU tensors under gloo it is what
the tests compare everything with. On CPU tensors `signal` runs its Triton kernel in the interpreter
and the same per-group collectives, so the whole signaled data path is tested without a GPU.

bias: the row-parallel bias is added once, after the reduction (Megatron's semantics). The signaled
kernel adds it in fp32 to the rows this rank will own (reduce-scatter) or on rank 0 (all-reduce),
which equals adding it after the sum without another pass over the output.

async_op=True returns a `Pending` instead of the output: the GEMM is issued and its communication may
still be running when the call returns, so the caller can queue independent work (the column-parallel
backward's wgrad GEMM, as Megatron overlaps its dgrad reduce-scatter) before `wait()`.
"""
import dataclasses
import functools
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from overlap_tp.ops import comm
from overlap_tp.ops.config import OverlapConfig, resolve_auto
from overlap_tp.kernels.signaled_gemm import check_operands, signaled_gemm, tma_unsupported_reason
from overlap_tp.ops.plan import TileOrder, TilePlan, make_plan

DEFAULT_CONFIG = OverlapConfig()
_warned = set()


def _warn_once(message: str):
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def check_inputs(a, w, bias, t, op):
    check_operands(a, w, bias)
    if a.shape[0] % t:
        raise ValueError(f"{op}: M={a.shape[0]} is not divisible by the group size t={t}")
    if a.is_cuda and a.device.index != torch.cuda.current_device():
        raise ValueError(f"{op}: a is on {a.device} but this rank's current CUDA device is "
                         f"cuda:{torch.cuda.current_device()} (one GPU per rank, set with torch.cuda.set_device)")


@functools.lru_cache(maxsize=None)
def _device_properties(device: torch.device):
    """torch.cuda.get_device_properties, asked once per device (every call of an op needs it)."""
    return torch.cuda.get_device_properties(device)


def _signal_unsupported_reason(a, w, config: OverlapConfig, m_local: int, n: int, op: str) -> Optional[str]:
    """Why the signaled kernel cannot run here, or None."""
    tma = tma_unsupported_reason(a, w)
    if tma is not None:
        return tma
    if a.is_cuda and _device_properties(a.device).major < 9:
        return f"the signaled GEMM needs TMA (compute capability >= 9.0), {torch.cuda.get_device_name(a.device)} lacks it"
    if op != "ag_gemm" and config.schedule == "tile_exact" and (m_local % config.block_m or n % config.block_n):
        return (f"schedule 'tile_exact' needs M/t={m_local} % block_m={config.block_m} == 0 and "
                f"N={n} % block_n={config.block_n} == 0")
    return None


def tuned_config(config: OverlapConfig, op: str, a, w, group) -> OverlapConfig:
    """method='auto': the tuner's config for this op and shape (overlap_tp.tune.choose: this process's memo,
    else the tuning cache, else measured once on every rank of the group together; it returns 'off' where
    overlap does not pay). CPU tensors run 'off' with a warning: there is nothing to tune without a GPU."""
    if config.method != "auto":
        return config
    if not a.is_cuda:
        _warn_once(f"overlap_tp {op}: method='auto' runs 'off' on CPU tensors (the tuner measures on GPUs only)")
        return dataclasses.replace(config, method="off")
    t = dist.get_world_size(group)
    m = a.shape[0] * t if op == "ag_gemm" else a.shape[0]
    return resolve_auto(op, m, w.shape[0], a.shape[1], a.dtype, a.device, group, config)


def prepare(op, a, w, bias, group, config, rows_split: bool):
    """What every dense op does first: resolve the group (None: Megatron's TP group), check the inputs
    (rows divisible by t where `rows_split`: the reduce-scatter's output), resolve `auto` to the tuner's
    config. Returns (group, t, rank, config)."""
    group = comm.resolve_group(group)
    t, rank = dist.get_world_size(group), dist.get_rank(group)
    check_inputs(a, w, bias, t if rows_split else 1, op)
    return group, t, rank, tuned_config(config or DEFAULT_CONFIG, op, a, w, group)


def resolve_method(config, a, w, m_local, n, op):
    """The method that runs (config.method after tuned_config), checked to be runnable."""
    if config.method == "signal":
        reason = _signal_unsupported_reason(a, w, config, m_local, n, op)
        if reason is not None:
            raise ValueError(f"{op}: method='signal' cannot run: {reason}")
    return config.method


# ---------------------------------------------------------------------------------------------------
# Plans and their per-device state
# ---------------------------------------------------------------------------------------------------

@dataclass
class PlanState:
    """A plan's tables on the device, its group counters and how many calls have raised them."""
    plan: TilePlan
    tiles: torch.Tensor
    counters: torch.Tensor
    tile_order: Optional[TileOrder]   # the plan's TileOrder with its map on the device
    calls: int = 0
    done: Optional[torch.cuda.Event] = field(default=None)

    def next_targets(self):
        self.calls += 1
        return [(self.calls * g) & 0xFFFFFFFF for g in self.plan.group_tiles]


_plan_states = {}


def plan_state(schedule, m, n, world, config, elem_bytes, device) -> PlanState:
    key = (schedule, m, n, world, config.block_m, config.block_n, config.groups, elem_bytes, str(device))
    if key not in _plan_states:
        plan = make_plan(schedule, m, n, world, config.block_m, config.block_n, config.groups, elem_bytes)
        order = plan.tile_order
        if order is not None:
            order = TileOrder(order.block_m, order.block_n, order.slot_of.to(device))
        _plan_states[key] = PlanState(plan, plan.tiles.to(device),
                                      torch.zeros(plan.num_groups, dtype=torch.int32, device=device), order)
    return _plan_states[key]


def gemm_programs(device: torch.device, config: OverlapConfig) -> int:
    """Persistent-GEMM grid: every SM but those left to the collective (at least one program)."""
    if device.type != "cuda":
        return 4
    return max(1, _device_properties(device).multi_processor_count - config.comm_sms)


# ---------------------------------------------------------------------------------------------------
# The signaled path, shared by gemm_rs and gemm_ar
# ---------------------------------------------------------------------------------------------------

def _signaled(a, w, bias, bias_rows, state: PlanState, out, collective, config, describe) -> torch.Tensor:
    """Run the signaled GEMM into a staging matrix (all-reduce plans: into `out` itself) and, on the
    comm stream, each group's `collective(out_rows, staging_rows)` behind the group's counter. Returns
    the staging matrix, which the comm stream reads until the caller's stream has joined it."""
    plan = state.plan
    # All-reduce plans (world 1) store in place; reduce-scatter plans need the [t, rows, N] staging.
    staging = out if plan.world == 1 else torch.empty(plan.staging_shape, dtype=a.dtype, device=a.device)
    engine = comm.comm_engine(a.device)
    targets = state.next_targets()
    programs = gemm_programs(a.device, config)

    def collectives_behind_counters():
        for g, c in enumerate(plan.collectives):
            engine.wait_counter(state.counters, g, targets[g])
            collective(out[c.dst_lo:c.dst_hi], staging[c.src_lo:c.src_hi])

    if engine.stream is None:   # CPU: the interpreter finishes the kernel before the collectives start
        signaled_gemm(a, w, staging, state.tiles, state.counters, programs, config, bias, bias_rows)
        collectives_behind_counters()
        return staging
    current = torch.cuda.current_stream(a.device)
    if state.done is not None:      # counters are shared with the previous call of this plan
        current.wait_event(state.done)
    engine.stream.wait_stream(current)   # before the GEMM launch: inputs and buffers ready, no more
    signaled_gemm(a, w, staging, state.tiles, state.counters, programs, config, bias, bias_rows)
    with torch.cuda.stream(engine.stream):
        collectives_behind_counters()
        state.done = torch.cuda.Event()
        state.done.record(engine.stream)
    engine.watch(state.done, describe, state.counters, targets)
    return staging


def collectives_for(method, group, device, config):
    """`off` is Megatron's path, torch.distributed; the overlapped methods use the capped communicator."""
    return comm.TorchCollectives(group) if method == "off" else comm.collectives(group, device, config.comm_sms)


def chunk_bounds(rows: int, chunks: int):
    chunks = max(1, min(chunks, rows))
    base, extra = divmod(rows, chunks)
    bounds, lo = [], 0
    for i in range(chunks):
        hi = lo + base + (i < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _decomposed(a, w, out, compute_chunk, collective, chunks, rows):
    """Chunk i's cuBLAS GEMM on the current stream, its collective on the comm stream behind an event.
    Returns the staged chunks, which the comm stream reads until the caller's stream has joined it."""
    engine = comm.comm_engine(a.device)
    current = torch.cuda.current_stream(a.device) if a.is_cuda else None
    staged_chunks = []
    for lo, hi in chunk_bounds(rows, chunks):
        staged = compute_chunk(lo, hi)
        if current is None:
            collective(out[lo:hi], staged)
            continue
        staged_chunks.append(staged)
        engine.stream.wait_stream(current)
        with torch.cuda.stream(engine.stream):
            collective(out[lo:hi], staged)
    return staged_chunks


class Pending:
    """An op issued with async_op=True whose communication may still be running. wait() makes the
    caller's current stream wait for it and returns the output. Until then it holds every buffer the
    transfer reads or writes, so the caching allocator cannot hand one to the work queued in between."""

    def __init__(self, finish: Callable[[], torch.Tensor], *buffers):
        self._finish, self._buffers = finish, buffers

    def wait(self) -> torch.Tensor:
        if self._finish is None:
            raise RuntimeError("overlap_tp: Pending.wait() called twice")
        out = self._finish()
        self._finish = self._buffers = None
        return out


def _after_comm_stream(device, result: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A Pending's finish for the comm-stream methods: join the comm stream, then produce the output."""
    def finish():
        if device.type == "cuda":
            torch.cuda.current_stream(device).wait_stream(comm.comm_engine(device).stream)
        return result()
    return finish


def _after_work(work, result: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A Pending's finish for torch.distributed's async work (None: it already completed)."""
    def finish():
        if work is not None:
            work.wait()
        return result()
    return finish


def _plus_bias(out, bias):
    """The output with the bias added once after the reduction (off and decompose; signal adds it in the epilogue)."""
    def result():
        if bias is not None:
            out.add_(bias)
        return out
    return result


# ---------------------------------------------------------------------------------------------------
# Public ops
# ---------------------------------------------------------------------------------------------------

def gemm_rs(a: torch.Tensor, w: torch.Tensor, group=None, *, bias: Optional[torch.Tensor] = None,
            config: Optional[OverlapConfig] = None, async_op: bool = False):
    """reduce_scatter(a @ w.T + bias) along dim 0: rank k gets rows [k*M/t, (k+1)*M/t), bias added once.
    async_op=True: a Pending whose wait() returns that."""
    group, t, rank, config = prepare("gemm_rs", a, w, bias, group, config, rows_split=True)
    m, n = a.shape[0], w.shape[0]
    m_local = m // t
    method = resolve_method(config, a, w, m_local, n, "gemm_rs")
    if method == "signal" and config.transport == "p2p":
        if not a.is_cuda or dist.get_backend(group) != "nccl":
            raise ValueError("gemm_rs: transport='p2p' needs CUDA tensors and an NCCL group (symmetric memory)")
        from overlap_tp.ops.p2p import gemm_rs_p2p
        out = gemm_rs_p2p(a, w, bias, group, rank, t, config, gemm_programs(a.device, config))
        pending = Pending(lambda: out)   # complete: its sum runs on the current stream
        return pending if async_op else pending.wait()
    coll = collectives_for(method, group, a.device, config)

    def collective(dst, src):
        coll.reduce_scatter(dst, src)

    out = torch.empty(m_local, n, dtype=a.dtype, device=a.device)
    if method == "off":
        partial = a @ w.t()
        pending = Pending(_after_work(coll.reduce_scatter(out, partial, async_op=async_op), _plus_bias(out, bias)),
                          partial)
    elif method == "decompose":
        a3, wt = a.view(t, m_local, -1), w.t()

        def chunk(lo, hi):
            return torch.matmul(a3[:, lo:hi], wt).view(t * (hi - lo), n)

        staged = _decomposed(a, w, out, chunk, collective, config.chunks, m_local)
        pending = Pending(_after_comm_stream(a.device, _plus_bias(out, bias)), staged)
    else:
        state = plan_state(config.schedule, m, n, t, config, a.element_size(), a.device)
        order = state.tile_order
        received = out if order is None else torch.empty(state.plan.out_shape, dtype=a.dtype, device=a.device)
        staging = _signaled(a, w, bias, (rank * m_local, (rank + 1) * m_local), state, received, collective, config,
                            f"gemm_rs(M={m}, N={n}, K={a.shape[1]}, t={t}, {config.schedule})")
        result = (lambda: out) if order is None else (lambda: order.undo(received))
        pending = Pending(_after_comm_stream(a.device, result), staging, received)
    return pending if async_op else pending.wait()


def gemm_ar(a: torch.Tensor, w: torch.Tensor, group=None, *, bias: Optional[torch.Tensor] = None,
            config: Optional[OverlapConfig] = None, async_op: bool = False):
    """all_reduce(a @ w.T) + bias, bias added once. async_op=True: a Pending whose wait() returns that."""
    group, t, rank, config = prepare("gemm_ar", a, w, bias, group, config, rows_split=False)
    m, n = a.shape[0], w.shape[0]
    method = resolve_method(config, a, w, m, n, "gemm_ar")
    if method == "signal" and config.transport != "nccl":
        raise ValueError(f"gemm_ar: transport={config.transport!r} is implemented for gemm_rs only; use 'nccl'")
    coll = collectives_for(method, group, a.device, config)

    def collective(dst, src):   # every all-reduce path stores its rows in place: src is dst
        coll.all_reduce(dst)

    if method == "off":
        out = a @ w.t()
        pending = Pending(_after_work(coll.all_reduce(out, async_op=async_op), _plus_bias(out, bias)))
    elif method == "decompose":
        out = torch.empty(m, n, dtype=a.dtype, device=a.device)

        def chunk(lo, hi):
            return torch.mm(a[lo:hi], w.t(), out=out[lo:hi])

        _decomposed(a, w, out, chunk, collective, config.chunks, m)
        pending = Pending(_after_comm_stream(a.device, _plus_bias(out, bias)), out)
    else:
        state = plan_state(config.schedule, m, n, 1, config, a.element_size(), a.device)
        out = torch.empty(state.plan.out_shape, dtype=a.dtype, device=a.device)
        _signaled(a, w, bias, (0, m) if rank == 0 else (0, 0), state, out, collective, config,
                  f"gemm_ar(M={m}, N={n}, K={a.shape[1]}, t={t}, {config.schedule})")
        result = (lambda: out) if state.tile_order is None else (lambda: state.tile_order.undo(out))
        pending = Pending(_after_comm_stream(a.device, result), out)
    return pending if async_op else pending.wait()
