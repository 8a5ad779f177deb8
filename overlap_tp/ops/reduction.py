"""The reduction side that GEMM+ReduceScatter and GEMM+AllReduce share: the signaled GEMM whose groups'
collectives start behind its counters, and the decomposed cuBLAS chunks.

Signaled, per call (CUDA):
    fork:  the comm stream waits for the caller's stream (inputs and buffers ready)
    GEMM:  the persistent Triton GEMM on the caller's stream stores group g's tiles into the staging matrix
           and raises counter g once per tile (release)
    comm:  per group, wait until counter g == its tile count, reset it to 0, then the group's collective
    join:  the caller's stream waits for the comm stream (at once, or in Pending.wait() with async_op)
The counters start and end every call at zero, so the same waits are right on every call and on every
replay of a captured graph (overlap_tp/ops/comm.py, CommEngine.wait_counter).
"""
from typing import Callable, Optional

import torch

from overlap_tp.kernels.signaled_gemm import SignaledGemm, default_offsets
from overlap_tp.ops import comm
from overlap_tp.ops.tile_plan import TileOrder, TilePlan, make_plan


class DevicePlan:
    """A tile plan with its table, counters and TileOrder on a device: what the signaled GEMM alone needs
    (the tuner's and the benchmarks' GEMM-only timings)."""

    def __init__(self, plan: TilePlan, device: torch.device):
        self.plan = plan
        self.tiles = plan.tiles.to(device)
        self.counters = torch.zeros(plan.num_groups, dtype=torch.int32, device=device)
        order = plan.tile_order
        self.tile_order = None if order is None else TileOrder(order.block_m, order.block_n, order.slot_of.to(device))


def device_plan(schedule: str, m: int, n: int, world: int, config, elem_bytes: int, device) -> DevicePlan:
    """make_plan's plan for `config`'s tiles and groups, on `device`."""
    return DevicePlan(make_plan(schedule, m, n, world, config.block_m, config.block_n, config.groups, elem_bytes),
                      device)


class SignaledReduction:
    """One tile plan on the device: its table, counters and TileOrder, the GEMM launcher, and the group
    collectives as (group, tile count, output rows, staging rows)."""

    def __init__(self, plan: TilePlan, device: torch.device, config, programs: int, bias_rows, coll, collective: str,
                 engine=None):
        self.plan, self.device, self.coll = plan, device, coll
        on_device = DevicePlan(plan, device)
        self.tiles, self.counters, self.order = on_device.tiles, on_device.counters, on_device.tile_order
        self.gemm = SignaledGemm(self.tiles, programs, config, counters=self.counters, bias_rows=bias_rows)
        self.engine = comm.comm_engine(device) if engine is None else engine
        self.steps = tuple((g, plan.group_tiles[g], c.dst_lo, c.dst_hi, c.src_lo, c.src_hi)
                           for g, c in enumerate(plan.collectives))
        self.collective = collective   # "reduce_scatter" | "all_reduce" (in place: source rows = output rows)
        if device.type == "cuda":
            default_offsets(device)       # the kernel's default offset table, made now rather than under capture
            self.engine.prepare_graph_waits()

    def run(self, a, w, bias, received, staging, watched) -> Callable[[], None]:
        """The GEMM into `staging` and every group's collective into `received`; returns the join (the caller's
        stream waits for the comm stream: call it before reading `received`)."""
        def collective(g, stream):
            _, _, dst_lo, dst_hi, src_lo, src_hi = self.steps[g]
            if self.collective == "reduce_scatter":
                self.coll.reduce_scatter(received[dst_lo:dst_hi], staging[src_lo:src_hi], stream=stream)
            else:
                self.coll.all_reduce(received[dst_lo:dst_hi], stream=stream)

        return self.engine.gemm_then_collectives(lambda: self.gemm(a, w, staging, bias), self.counters,
                                                 self.plan.group_tiles, collective, watched)


def decomposed(device, out, compute_chunk, collective, bounds) -> list:
    """Chunk i's cuBLAS GEMM on the current stream, its collective on the comm stream behind the chunk.
    Returns the staged chunks, which the comm stream reads until the caller's stream has joined it."""
    engine = comm.comm_engine(device)
    staged_chunks = []
    for lo, hi in bounds:
        staged = compute_chunk(lo, hi)
        if engine.stream is None:
            collective(out[lo:hi], staged, None)
            continue
        staged_chunks.append(staged)
        engine.fork(engine.current(), comm.capturing(device))
        collective(out[lo:hi], staged, engine.raw)
    return staged_chunks


def joined(device, result: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A Pending's finish for the comm-stream methods: join the comm stream, then produce the output."""
    def finish():
        if device.type == "cuda":
            engine = comm.comm_engine(device)
            engine.join(engine.current(), comm.capturing(device))
        return result()
    return finish


def after_work(work, result: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A Pending's finish for torch.distributed's async work (None: it already completed)."""
    def finish():
        if work is not None:
            work.wait()
        return result()
    return finish


def plus_bias(out, bias: Optional[torch.Tensor]) -> Callable[[], torch.Tensor]:
    """The output with the bias added once after the reduction (off and decompose; signal adds it in the epilogue)."""
    def result():
        if bias is not None:
            out.add_(bias)
        return out
    return result

