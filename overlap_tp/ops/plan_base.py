"""The op plans' base: what every op plan shares: the two-phase contract, checks, the persistent GEMM's grid,
Pending (and the finishes its methods use), and the functional API's plan cache.

An op plan (a strategy of GemmRS, GemmAR or AgGemm; the expert ops keep a state per routing instead: ops/expert.py) is
built once per (group, shape, dtype, device, config): the group and this rank's place in it, a cross-rank agreement
check, the config resolved (`auto` asks the tuner, once), tile plans and their device tables, synchronisation words,
buffers, communicators and the kernel launcher. Calling it checks cheap invariants and launches; nothing on that path
builds, allocates beyond the outputs or synchronizes with the host, so a call can be captured in a CUDA graph.
Building one needs the host (collectives, allocations, copies): under capture it is an error, so build plans (or run
one eager step) before capturing.
"""
import contextlib
import functools
import warnings
from collections import OrderedDict
from typing import Callable, Optional

import torch
import torch.distributed as dist

from overlap_tp.kernels.fp8_quant import ScaledFp8
from overlap_tp.kernels.signaled_gemm import SignaledGemm, check_operands, tma_unsupported_reason, weight_layout
from overlap_tp.ops import comm
from overlap_tp.ops.config import OverlapConfig
from overlap_tp.ops.fp8 import OUT_DTYPE, Fp8Operands, fp8_config
from overlap_tp.ops.resolve import resolve
from overlap_tp.ops.watchdog import Watched

_warned = set()


def warn_once(message: str):
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


@functools.lru_cache(maxsize=None)
def device_properties(device: torch.device):
    """torch.cuda.get_device_properties, asked once per device."""
    return torch.cuda.get_device_properties(device)


def gemm_programs(device: torch.device, config: OverlapConfig, spare_sms: int = 0) -> int:
    """Persistent-GEMM grid: every SM but those left to the collective, and at least `spare_sms` (at least one
    program)."""
    if device.type != "cuda":
        return 4
    if config.comm_sms is None:
        raise ValueError("gemm_programs: config.comm_sms is unset; resolve the config first (ops/resolve.py "
                         "fill_defaults or resolve)")
    return max(1, device_properties(device).multi_processor_count - max(config.comm_sms, spare_sms))


def chunk_bounds(rows: int, chunks: int):
    """Rows [0, rows) in `chunks` near-equal parts (the decompose method's M-chunks)."""
    return comm.near_equal_parts(0, rows, chunks)


class Pending:
    """An op issued with async_op=True whose communication may still be running. wait() makes the
    caller's current stream wait for it and returns the output. Until then it holds every buffer the
    transfer reads or writes, so the caching allocator cannot hand one to the work queued in between."""

    def __init__(self, finish: Callable[[], torch.Tensor], *buffers, deferred_sum=None):
        self._finish, self._buffers = finish, buffers
        # gemm_rs on the p2p transport: its DeferredSum (wait() runs it; a consumer may run it instead)
        self.deferred_sum = deferred_sum

    def wait(self) -> torch.Tensor:
        if self._finish is None:
            raise RuntimeError("overlap_tp: Pending.wait() called twice")
        out = self._finish()
        self._finish = self._buffers = None
        return out


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


def check_not_capturing(device: torch.device, what: str):
    if comm.capturing(device):
        raise RuntimeError(f"overlap_tp {what}: the op's plan would be built during CUDA graph capture, which "
                           f"cannot run its set-up (collectives, allocations, host copies). Build it before the "
                           f"capture: run the op (or one training step) eagerly first, or construct the plan")


class OpPlan:
    """The dense ops' plan base. `m` is the rows of `a` as calls pass it (ag_gemm: this rank's shard), `n` and `k` the
    weight's [N, K] (w as calls pass it: nn.Linear layout or the transposed view of a row-major [K, N]).

    An op's class (GemmRS, GemmAR, AgGemm: a subclass of this one that sets `op` and `rows_split`, the output's rows
    split over the group) is its plans' factory: calling it checks the arguments, agrees with the other ranks,
    resolves the config (`_resolve`), asks the op's `strategy_for` which strategy runs that config, and returns a plan
    of that strategy with its state built (`build`). A strategy is a subclass of the op's class, one per way of running
    the op (a method on a transport: decompose over NCCL, signal over the copy engines, ...): it sets `variant` (its
    label in describe()), builds its state in `build` and launches in __call__. A config that no strategy runs is a
    ValueError naming why (strategy_for). Calling a strategy's class builds that strategy, or raises where the
    resolved config names another.

    FP8 operands (ops/fp8.py): a plan built with `fp8` (an Fp8Operands: a's and w's formats and scalings) takes
    ScaledFp8 a and w and returns `dtype` (bf16); its strategy is the FP8 counterpart of the one its config names."""

    op = ""
    rows_split = False
    variant = ""   # a strategy's label in describe(): its method (and transport)
    fp8 = None     # the plan's Fp8Operands, or None: bf16 / fp16 operands
    launcher = SignaledGemm   # the signaled strategies' GEMM launcher (Fp8Plan's for FP8 operands)

    def __new__(cls, group, m: int, n: int, k: int, dtype=torch.bfloat16, device=None,
                config: Optional[OverlapConfig] = None, instance: int = 0, fp8: Optional[Fp8Operands] = None,
                **options):
        """instance: which plan of this shape (cached_plan); each instance's transfers run on a comm stream of its own
        (comm.comm_engine), so that two plans' calls in flight at once (the token split's halves) do not queue behind
        each other. fp8: the FP8 operands' Fp8Operands (None: dtype's). options: the op's own (AgGemm: gather), for
        strategy_for and build."""
        plan = super().__new__(cls)
        plan._set_up(group, m, n, k, dtype, device, config, instance, fp8)
        strategy = plan.strategy_for(**options)
        if not issubclass(strategy, cls):
            raise ValueError(f"overlap_tp {cls.op}: {cls.__name__} does not run this config ({strategy.__name__} "
                             f"does): build the plan through the op's class")
        plan.__class__ = strategy   # from here on the plan is the strategy's (it has the base's state only so far)
        plan.watched = Watched(plan.describe()) if plan.device.type == "cuda" else None
        plan.build(**options)
        return plan

    def _set_up(self, group, m, n, k, dtype, device, config, instance, fp8):
        """The arguments checked, the group's agreement on them, the config resolved (_resolve)."""
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if device.type == "meta":
            raise ValueError(f"overlap_tp {self.op}: meta tensors have no data to compute on; build the op for a "
                             f"CUDA device (or CPU under gloo)")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"overlap_tp {self.op}: dtype {dtype}: the ops run bf16 or fp16 GEMMs")
        for name, value in (("M", m), ("N", n), ("K", k)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"overlap_tp {self.op}: {name}={value!r}: expected an int >= 0")
        if not isinstance(instance, int) or instance < 0:
            raise ValueError(f"overlap_tp {self.op}: instance={instance!r}: expected an int >= 0")
        if fp8 is not None and (not isinstance(fp8, Fp8Operands) or dtype != OUT_DTYPE):
            raise ValueError(f"overlap_tp {self.op}: fp8={fp8!r} with dtype {dtype}: FP8 operands are described by "
                             f"an Fp8Operands and give {OUT_DTYPE}")
        check_not_capturing(device, self.op)
        self.instance, self.fp8 = instance, fp8
        self.group = comm.resolve_group(group)
        self.t, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.m, self.n, self.k, self.dtype, self.device = m, n, k, dtype, device
        config = config or OverlapConfig()
        if not isinstance(config, OverlapConfig):
            raise TypeError(f"overlap_tp {self.op}: config must be an OverlapConfig, got {type(config).__name__}")
        if self.rows_split and m % self.t:
            raise ValueError(f"{self.op}: M={m} is not divisible by the group size t={self.t}")
        comm.agree(self.group, dict(op=self.op, m=m, n=n, k=k, dtype=dtype, fp8=fp8, config=config),
                   self._describe(config.method or "auto"))   # unset: as given
        self.config = self._resolve(config)
        self.method = self.config.method
        # what check_call compares per call, made once: the operands' shapes, and whether TMA must address them
        # (the signaled GEMM on a GPU: a call's tensors are on the plan's device, checked first)
        self._shapes = ((m, k), (n, k), (n,))
        self._tma_operands = self.method == "signal" and device.type == "cuda"

    def strategy_for(self, **options) -> type:
        """The strategy (a subclass of the op's class) that runs the resolved config, or a ValueError saying why none
        does. Set by each op."""
        raise NotImplementedError(f"overlap_tp {self.op}: an op's class defines strategy_for")

    def build(self, **options):
        """The strategy's state (tile plans, buffers, synchronisation words, communicators, launchers). Set by each
        strategy."""
        raise NotImplementedError(f"overlap_tp {self.op}: a strategy defines build")

    def describe(self) -> str:
        """The plan as messages name it: the op, its shape and its strategy's variant."""
        return self._describe(self.variant)

    def _describe(self, how: str) -> str:
        fp8 = "" if self.fp8 is None else f", {self.fp8}"
        return f"{self.op}(M={self.m}, N={self.n}, K={self.k}, t={self.t}, {how}{fp8})"

    @property
    def operand_bytes(self) -> int:
        """Bytes per element of the operands a gathers and tile plans size their chunks by (Fp8Plan: 1)."""
        return torch.finfo(self.dtype).bits // 8

    def _mm(self, a, w, out):
        """out = a @ w.T: the off strategies' GEMM (cuBLAS; Fp8Plan's is the scaled GEMM)."""
        torch.mm(a, w.t(), out=out)

    def _resolve(self, config: OverlapConfig) -> OverlapConfig:
        """config with every field resolved (ops/resolve.py: 'auto' through the tuner, 'off' where the result is empty
        or on CPU tensors for 'auto', the tile by shape) and checked to be runnable."""
        rows = self.m * self.t if self.op == "ag_gemm" else self.m   # the GEMM's rows (ag_gemm: gathered)
        if self.fp8 is not None:
            config = fp8_config(config, self.op, self.device, self.fp8)
        config = resolve(config, self.op, device=self.device, t=self.t, group=self.group, m=rows, n=self.n, k=self.k,
                         dtype=self.dtype, programs=lambda c: gemm_programs(self.device, c))
        if config.method == "signal":
            reason = self._signal_unsupported_reason(config)
            if reason is not None:
                raise ValueError(f"{self.op}: method='signal' cannot run: {reason}")
        return config

    def _signal_unsupported_reason(self, config: OverlapConfig) -> Optional[str]:
        if self.fp8 is not None:
            reason = self.fp8.signal_unsupported_reason(self.k, config)
            if reason is not None:
                return reason
        elif self.k % 8:
            return f"K={self.k} is not a multiple of 8 (TMA needs 16-byte row strides)"
        if self.device.type == "cuda" and device_properties(self.device).major < 9:
            return (f"the signaled GEMM needs TMA (compute capability >= 9.0), "
                    f"{torch.cuda.get_device_name(self.device)} lacks it")
        return None

    def check_call(self, a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]):
        """The call's operands are those the plan was built for (cheap: shapes, dtypes, device, layout)."""
        a_shape, w_shape, bias_shape = self._shapes
        if (a.shape != a_shape or w.shape != w_shape or a.dtype != self.dtype
                or w.dtype != self.dtype or a.device != self.device or w.device != self.device
                or not a.is_contiguous() or (bias is not None and bias.shape != bias_shape)):
            check_operands(a, w, bias)   # a general rule broken: its own message
            raise ValueError(f"{self.describe()}: called with a{tuple(a.shape)} {a.dtype} and w{tuple(w.shape)} "
                             f"{w.dtype} on {a.device}; the plan was built for a[{self.m}, {self.k}], "
                             f"w[{self.n}, {self.k}] {self.dtype} on {self.device}")
        if self._tma_operands:   # K % 8 was checked when the plan was built
            layout = weight_layout(w)
            if a.data_ptr() % 16 or w.data_ptr() % 16 or layout is None or (layout == "kn" and self.n % 8):
                reason = tma_unsupported_reason(a, w) or ("w must be row-major [N, K] or the transposed view of a "
                                                          "row-major [K, N]")
                raise ValueError(f"{self.describe()}: {reason}")


# ---------------------------------------------------------------------------------------------------
# The functional API's plans
# ---------------------------------------------------------------------------------------------------

MAX_CACHED_PLANS = 256
_plans = OrderedDict()


def cached_plan(cls, group, m, n, k, dtype, device, config, instance: int = 0, fp8: Optional[Fp8Operands] = None):
    """The plan of `cls` for these arguments, built at the first call (least recently used ones dropped past
    MAX_CACHED_PLANS, so shapes that change every step do not hold buffers forever). `instance` > 0: another plan of
    the same arguments, with buffers and synchronisation state of its own, for two calls of one shape in flight at
    once (the token split's halves: half A's p2p ReduceScatter is summed after half B's was issued). fp8: the FP8
    operands' formats and scalings (operand_plan_args), part of the key."""
    key = (cls, group, m, n, k, dtype, device, config, instance, fp8)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = cls(group, m, n, k, dtype, device, config, instance=instance, fp8=fp8)
        if len(_plans) > MAX_CACHED_PLANS:
            _plans.popitem(last=False)
    else:
        _plans.move_to_end(key)
    return plan


def operand_plan_args(a, w, bias=None, check: bool = True):
    """(m, n, k, dtype, device, fp8): what the functional API's plan for the operands a[m, k] and w[n, k] is built
    for. ScaledFp8 operands: their Fp8Operands (checked: Fp8Operands.of), the output OUT_DTYPE; tensors: their dtype,
    fp8 None, checked by check_operands (check=False: shapes only, for a caller that checks per call itself)."""
    if isinstance(a, ScaledFp8) or isinstance(w, ScaledFp8):
        fp8 = Fp8Operands.of(a, w, bias)
        return a.q.shape[0], w.q.shape[0], w.q.shape[1], OUT_DTYPE, a.q.device, fp8
    if check:
        check_operands(a, w, bias)
    return a.shape[0], w.shape[0], w.shape[1], a.dtype, a.device, None


def clear_plans():
    """Forget the functional API's plans (tests; after destroying a process group)."""
    _plans.clear()


@contextlib.contextmanager
def transient_plans():
    """The plans the functional API builds inside the block are dropped from its cache at the end (the plans cached
    before stay). For the tuner's candidates: each holds its buffers (on the p2p transports an [M, N] symmetric
    receive buffer: 64 MB at the 8B proj's shape, 128 MB at the 70B's), and a run keeps one config per shape, so the
    ones it does not pick would otherwise sit in the cache until 256 newer plans pushed them out."""
    before = set(_plans)
    try:
        yield
    finally:
        for key in [key for key in _plans if key not in before]:
            del _plans[key]
