"""GEMMs overlapped with collective reductions (NCCL's reduce-scatter or all-reduce, per group of rows): what
GEMM+ReduceScatter and GEMM+AllReduce share on the NCCL transport. The signaled GEMM whose groups' collectives start
behind its counters (SignaledReduction), and the decomposed cuBLAS chunks (decomposed).

Signaled, per call (CUDA):
    fork:  the comm stream waits for the caller's stream (inputs and buffers ready)
    GEMM:  the persistent Triton GEMM on the caller's stream stores group g's tiles into the staging matrix
           and raises counter g once per tile (release)
    comm:  per group, wait until counter g == its tile count, reset it to 0, then the group's collective
    join:  the caller's stream waits for the comm stream (at once, or in Pending.wait() with async_op)
The counters start and end every call at zero, so the same waits are right on every call and on every
replay of a captured graph (overlap_tp/ops/comm.py, CommEngine.wait_counter).
"""
from typing import Callable

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
    """One tile plan on the device: its table, counters and TileOrder, the GEMM launcher, the counters' waits
    and the group collectives as (output rows, staging rows). launcher: the GEMM's (SignaledGemm, or for FP8
    operands kernels.fp8_gemm.Fp8SignaledGemm: the same tables, counters and stores)."""

    def __init__(self, plan: TilePlan, device: torch.device, config, programs: int, bias_rows, coll, collective: str,
                 engine=None, launcher=SignaledGemm):
        self.plan, self.device, self.coll = plan, device, coll
        on_device = DevicePlan(plan, device)
        self.tiles, self.counters, self.order = on_device.tiles, on_device.counters, on_device.tile_order
        self.gemm = launcher(self.tiles, programs, config, counters=self.counters, bias_rows=bias_rows)
        self.engine = comm.comm_engine(device) if engine is None else engine
        self.waits = comm.CounterWaits(self.counters, plan.group_tiles)
        self.steps = tuple((c.dst_lo, c.dst_hi, c.src_lo, c.src_hi) for c in plan.collectives)
        self.collective = collective   # "reduce_scatter" | "all_reduce" (in place: source rows = output rows)
        # a raw NCCL communicator takes addresses: group g's (output, staging, count) offsets in elements, made once
        self.issue_at = getattr(coll, collective + "_at", None)
        n, in_place = plan.out_shape[1], collective == "all_reduce"
        self.spans = tuple((dst_lo * n, (dst_lo if in_place else src_lo) * n, (dst_hi - dst_lo) * n)
                           for dst_lo, dst_hi, src_lo, _ in self.steps)
        if device.type == "cuda":
            default_offsets(device)       # the kernel's default offset table, made now rather than under capture
            self.engine.prepare_graph_waits()

    def run(self, a, w, bias, received, staging, watched) -> Callable[[], None]:
        """The GEMM into `staging` and every group's collective into `received`; returns the join (the caller's
        stream waits for the comm stream: call it before reading `received`)."""
        if self.issue_at is not None:
            dst, src, size, dtype, spans, issue_at = (received.data_ptr(), staging.data_ptr(),
                                                      received.element_size(), received.dtype, self.spans,
                                                      self.issue_at)

            def collective(g, stream):
                dst_offset, src_offset, count = spans[g]
                issue_at(dst + dst_offset * size, src + src_offset * size, count, dtype, stream)
        else:
            def collective(g, stream):
                dst_lo, dst_hi, src_lo, src_hi = self.steps[g]
                if self.collective == "reduce_scatter":
                    self.coll.reduce_scatter(received[dst_lo:dst_hi], staging[src_lo:src_hi], stream=stream)
                else:
                    self.coll.all_reduce(received[dst_lo:dst_hi], stream=stream)

        gemm = self.gemm.launch_checked
        return self.engine.gemm_then_collectives(lambda: gemm(a, w, staging, bias), self.waits, collective, watched)


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
