"""FP8 operands through the dense ops (ag_gemm, gemm_rs, gemm_ar): what the FP8 strategies share.

    out = gemm_rs(a8, w8, group, bias=b, config=...)    a8, w8: kernels.fp8_quant.ScaledFp8, both K-major; out bf16

An op called with ScaledFp8 operands builds (and caches) a plan whose key holds an `Fp8Operands`: the formats and
scalings of a and w, so a plan serves one recipe. The op's `strategy_for` picks the FP8 counterpart of the strategy
the resolved config names (`fp8_counterpart`), or refuses with a ValueError naming what to use instead; each FP8
strategy is a class of its own (AgGemmOffFp8, GemmRSSignaledNcclFp8, ...: `Fp8Plan` first in its bases, then the bf16
strategy whose synchronisation, transfers and reductions it runs unchanged). What changes:
- the GEMM: the signaled strategies launch the FP8 signaled GEMM (kernels/fp8_gemm.py) over the same tile tables
  (`Fp8Plan.launcher`); the off strategies multiply with `scaled_mm` (torch's scaled GEMM on CUDA, the float64 product
  of the dequantized operands on CPU), one shard of a at a time with its own scales: every FP8 strategy has a
  same-shape reference;
- what moves: ag_gemm gathers FP8 rows (one byte per element) and every rank's scales, stacked (fp8_quant's gathered
  layout: tensorwise [t], one per rank, 1x128 [t, K/128, M/t]); gemm_rs and gemm_ar move bf16 partial products and
  reduce them exactly as the bf16 strategies do (nothing is reduced in FP8);
- the config: an FP8 plan's unset tile is FP8_TILES' for its scaling (block_k 128, which blockwise needs); 'auto' is not
  resolved for FP8 operands on CUDA (the tuner measures bf16 GEMMs), so such a config is refused.
The output is bf16 (OUT_DTYPE); a bias is a bf16 [N], added as by the bf16 strategies (once).
"""
import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from overlap_tp.kernels.fp8_gemm import Fp8SignaledGemm, check_scaled_operands
from overlap_tp.kernels.fp8_quant import (BLOCK, ScaledFp8, dequantize_reference, is_gathered, padded_k_blocks,
                                          scale_view_128x128, scale_view_1x128, shard_count, shards)
from overlap_tp.ops.config import OverlapConfig

OUT_DTYPE = torch.bfloat16
# The FP8 GEMM's tile where a config leaves it unset: BLOCK_K 128 (blockwise scaling promotes per 128 of K; at 128 an
# FP8 stage holds the bytes of a bf16 stage at 64), the tile the FP8 GEMM matched cuBLAS's tensorwise GEMM with
# (docs/fp8.md, Benchmarks).
# An FP8 plan's tile where its config leaves one unset, per a's scaling (block_k 128: blockwise promotes per 128 of
# K); blockwise: the fastest of the tiles measured on every GEMM of the 8B layer at t = 2 (docs/fp8.md)
FP8_TILES = {"tensorwise": dict(block_m=128, block_n=256, block_k=128, num_stages=3, num_warps=8),
             "1x128": dict(block_m=64, block_n=128, block_k=128, num_stages=3, num_warps=4)}
FORMAT_NAMES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


@dataclass(frozen=True)
class Fp8Operands:
    """What an FP8 plan multiplies: a's and w's FP8 dtypes and scalings (a pair the FP8 GEMM serves: tensorwise x
    tensorwise, 1x128 x 128x128, 1x128 x 1x128). Part of the plan's key and of the ranks' agreement."""

    a_dtype: torch.dtype
    a_scaling: str
    w_dtype: torch.dtype
    w_scaling: str

    @classmethod
    def of(cls, a: ScaledFp8, w: ScaledFp8, bias: Optional[torch.Tensor] = None) -> "Fp8Operands":
        """The operands' formats and scalings, checked (kernels.fp8_gemm.check_scaled_operands: ScaledFp8 both,
        K-major, the scales in their layouts) and a's scales its own (one tensorwise scale, or 1x128 [K/128, M]: a
        call quantizes its own shard or rows; a gathered operand's G shards' scales are what ag_gemm returns); a
        ValueError names the broken constraint."""
        check_scaled_operands(a, w, bias)
        if is_gathered(a):
            raise ValueError(f"overlap_tp: a's scales must be its own (tensorwise one scale, 1x128 [K/128, M]); got "
                             f"ds {tuple(a.ds.shape)}, the scales of {shard_count(a)} gathered shard(s)")
        if bias is not None and bias.dtype != OUT_DTYPE:
            raise ValueError(f"overlap_tp: with FP8 operands the bias is {OUT_DTYPE} (the output's dtype); got "
                             f"{bias.dtype}")
        return cls(a.q.dtype, a.scaling, w.q.dtype, w.scaling)

    def __str__(self):
        return (f"fp8 {FORMAT_NAMES[self.a_dtype]} {self.a_scaling} x {FORMAT_NAMES[self.w_dtype]} "
                f"{self.w_scaling}")

    @property
    def blockwise(self) -> bool:
        return self.a_scaling != "tensorwise"

    def scale_shapes(self, m: int, n: int, k: int):
        """The ds shapes of a[m, k] and w[n, k] (fp8_quant's layouts)."""
        a = (1,) if self.a_scaling == "tensorwise" else (k // BLOCK, m)
        if self.w_scaling == "tensorwise":
            w = (1,)
        else:
            w = (-(-n // BLOCK), padded_k_blocks(k)) if self.w_scaling == "128x128" else (k // BLOCK, n)
        return a, w

    def gathered_scale_shape(self, t: int, m: int, k: int):
        """The ds shape of t gathered shards a[m, k] (fp8_quant's gathered layout: every shard's scales stacked)."""
        return (t,) if self.a_scaling == "tensorwise" else (t, k // BLOCK, m)

    def signal_unsupported_reason(self, k: int, config: OverlapConfig) -> Optional[str]:
        """Why the FP8 signaled GEMM cannot run K = k with config's tile, or None."""
        if k % 16:
            return f"K={k} is not a multiple of 16 (TMA needs 16-byte rows: 16 FP8 elements)"
        if self.blockwise and config.block_k != BLOCK:
            return (f"blockwise scaling promotes per {BLOCK} of K: it needs block_k={BLOCK}, the config has "
                    f"block_k={config.block_k}")
        return None


def fp8_config(config: OverlapConfig, op: str, device: torch.device, fp8: "Fp8Operands") -> OverlapConfig:
    """An FP8 plan's config before the resolver: FP8_TILES[a's scaling] in the tile fields left unset. Method 'auto'
    (or unset) on CUDA tensors is a ValueError: the tuner measures bf16 GEMMs, whose choice is no measurement of the
    FP8 ones (on CPU tensors the resolver runs 'auto' as 'off', as for bf16)."""
    if config.method in (None, "auto") and device.type == "cuda":
        raise ValueError(f"overlap_tp {op} with FP8 operands: method 'auto' is not tuned for FP8 (the tuner measures "
                         f"bf16 GEMMs); name the method: OverlapConfig(method='signal') or method='off'")
    unset = {name: value for name, value in FP8_TILES[fp8.a_scaling].items() if getattr(config, name) is None}
    return dataclasses.replace(config, **unset) if unset else config


def fp8_counterpart(plan, strategy: type, counterparts: dict) -> type:
    """The FP8 strategy of an FP8 plan whose resolved config the bf16 strategy `strategy` runs: counterparts[strategy],
    or a ValueError naming what to use instead (method 'decompose', cuBLAS per chunk or region, has none; a
    counterparts value that is a string says why that strategy has none)."""
    if plan.method == "decompose":
        raise ValueError(f"overlap_tp {plan.op} with FP8 operands: method='decompose' (cuBLAS per chunk) has no FP8 "
                         f"strategy; use method='signal' (the FP8 signaled GEMM) or method='off'")
    found = counterparts[strategy]
    if isinstance(found, str):
        raise ValueError(f"overlap_tp {plan.op} with FP8 operands: {found}")
    return found


class Fp8Plan:
    """What every FP8 strategy adds to the bf16 strategy it follows (its second base): the FP8 GEMM as the signaled
    launcher, one byte per gathered element, the off strategies' scaled GEMM, and the per-call check of ScaledFp8
    operands against the plan's Fp8Operands and shapes (cheap: shapes, dtypes, scalings, devices)."""

    launcher = Fp8SignaledGemm
    operand_bytes = 1

    def _mm(self, a: ScaledFp8, w: ScaledFp8, out: torch.Tensor):
        scaled_mm(a, w, out)

    @functools.cached_property
    def _scale_shapes(self):
        """a's and w's ds shapes (Fp8Operands.scale_shapes at the plan's shape)."""
        return self.fp8.scale_shapes(self.m, self.n, self.k)

    def check_call(self, a: ScaledFp8, w: ScaledFp8, bias: Optional[torch.Tensor]):
        self._check_a(a)
        _, w_ds = self._scale_shapes
        fp8, (_, w_shape, bias_shape) = self.fp8, self._shapes
        if (not isinstance(w, ScaledFp8) or w.q.shape != w_shape or w.q.dtype != fp8.w_dtype
                or w.scaling != fp8.w_scaling or w.ds.shape != w_ds or w.ds.dtype != torch.float32
                or w.q.device != self.device or w.ds.device != self.device or not w.q.is_contiguous()
                or not w.ds.is_contiguous()
                or (bias is not None and (bias.shape != bias_shape or bias.dtype != OUT_DTYPE
                                          or bias.device != self.device))):
            self._mismatch(a, w, bias)
        if self._tma_operands and w.q.data_ptr() % 16:
            raise ValueError(f"{self.describe()}: w's FP8 rows do not start on a 16-byte boundary (TMA)")

    def _check_a(self, a: ScaledFp8):
        """a is the operand the plan was built for (ag_gemm: this rank's shard), with its own scales."""
        a_ds, _ = self._scale_shapes
        fp8, (a_shape, _, _) = self.fp8, self._shapes
        if (not isinstance(a, ScaledFp8) or a.q.shape != a_shape or a.q.dtype != fp8.a_dtype
                or a.scaling != fp8.a_scaling or a.ds.shape != a_ds or a.ds.dtype != torch.float32
                or a.q.device != self.device or a.ds.device != self.device or not a.q.is_contiguous()
                or not a.ds.is_contiguous()):
            self._mismatch(a, None, None)
        if self._tma_operands and a.q.data_ptr() % 16:
            raise ValueError(f"{self.describe()}: a's FP8 rows do not start on a 16-byte boundary (TMA)")

    def _mismatch(self, a, w, bias):
        """The ValueError of a call whose operands are not those the plan was built for: a general rule's own
        message where they break one, else what was expected."""
        if w is not None:
            check_scaled_operands(a, w, bias)
        elif not isinstance(a, ScaledFp8):
            raise ValueError(f"{self.describe()}: a must be a ScaledFp8; got {type(a).__name__}")

        def text(x):
            return "-" if x is None else f"{tuple(x.q.shape)} {x.q.dtype} {x.scaling} ds{tuple(x.ds.shape)} on " \
                                         f"{x.q.device}"
        a_ds, w_ds = self._scale_shapes
        raise ValueError(f"{self.describe()}: called with a {text(a)}, w {text(w)}"
                         f"{'' if bias is None else f', bias {tuple(bias.shape)} {bias.dtype}'}; the plan was built "
                         f"for a[{self._shapes[0][0]}, {self.k}] ds{a_ds}, w[{self.n}, {self.k}] ds{w_ds}, "
                         f"{self.fp8}, bias [{self.n}] {OUT_DTYPE}, on {self.device}")


def scaled_mm(a: ScaledFp8, w: ScaledFp8, out: torch.Tensor):
    """out[M, N] = (A * sa) @ (W * sw).T in out's dtype: the off strategies' GEMM, shard by shard of a (each shard
    with its own scales: a gathered a's G shards). On CUDA torch's scaled GEMM of each shard where it takes the
    operands (K and N multiples of 16, compute capability 8.9 or newer): torch._scaled_mm tensorwise,
    torch.nn.functional.scaled_mm blockwise (1x128 x 128x128 or 1x128 x 1x128; where this torch or cuBLAS lacks
    the blockwise kernel, the float product below). Elsewhere, and on CPU tensors, the float64 product of the
    dequantized operands rounded once to out's dtype."""
    lo = 0
    for shard in shards(a):
        hi = lo + shard.q.shape[0]
        out[lo:hi].copy_(_scaled_product(shard, w, out.dtype))
        lo = hi


_warned = set()


def _warn_float_product(what: str, error: Exception):
    """Once per operand kind: the blockwise scaled GEMM is not available here, the off strategy multiplies in
    float64 (exact, slow)."""
    if what not in _warned:
        _warned.add(what)
        warnings.warn(f"overlap_tp FP8 off strategy: torch's blockwise scaled_mm refused {what} ({error}); "
                      f"multiplying the dequantized operands in float64 instead")


def _scaled_product(a: ScaledFp8, w: ScaledFp8, dtype: torch.dtype) -> torch.Tensor:
    k, n = a.q.shape[1], w.q.shape[0]
    q = a.q
    if (q.is_cuda and k % 16 == 0 and n % 16 == 0 and q.shape[0] > 0
            and torch.cuda.get_device_capability(q.device) >= (8, 9)):
        if a.scaling == "tensorwise":
            return torch._scaled_mm(q, w.q.t(), scale_a=a.ds.reshape(()), scale_b=w.ds.reshape(()), out_dtype=dtype)
        kinds = getattr(F, "ScalingType", None)
        if kinds is not None and hasattr(kinds, "BlockWise1x128"):
            w_kind, w_view = ((kinds.BlockWise128x128, scale_view_128x128) if w.scaling == "128x128" else
                              (kinds.BlockWise1x128, scale_view_1x128))
            try:
                return F.scaled_mm(q, w.q.t(), scale_view_1x128(a.ds), kinds.BlockWise1x128, w_view(w.ds), w_kind,
                                   output_dtype=dtype)
            except (RuntimeError, ValueError) as error:   # no blockwise kernel for this pair, format or shape
                _warn_float_product(f"{tuple(q.shape)} x {tuple(w.q.shape)} {a.scaling} x {w.scaling}", error)
    return (dequantize_reference(a) @ dequantize_reference(w).t()).to(dtype)
