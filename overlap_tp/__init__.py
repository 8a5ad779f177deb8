"""overlap_tp: Megatron TP/SP linear layers whose GEMMs signal per group of tiles so that each
group's collective starts while the rest of the GEMM still runs.

Public ops (the contract other parts and outside benchmarks call):
    gemm_rs(a, w, group=None, *, bias=None, config=None, async_op=False)  -> reduce_scatter(a @ w.T) [+ bias]
    gemm_ar(a, w, group=None, *, bias=None, config=None, async_op=False)  -> all_reduce(a @ w.T) [+ bias]
        (async_op=True: a Pending whose wait() joins the communication and returns the result)
    ag_gemm(a_shard, w, group=None, *, bias=None, config=None, return_gathered=False)
                                                           -> all_gather(a_shard) @ w.T [+ bias]
    a2a_gemm(x, counts, w, group=None, *, config=None, return_received=False)
                                                           -> MoE dispatch (all-to-all) + grouped fc1 GEMM
    gemm_a2a(h, counts, w, group=None, *, config=None)     -> grouped fc2 GEMM + MoE combine (all-to-all)
    OverlapConfig                                          how they run (method, schedule, groups, ...)
"""
from overlap_tp.ops.config import OverlapConfig
from overlap_tp.ops.expert import a2a_gemm, gemm_a2a
from overlap_tp.ops.ag_gemm import ag_gemm
from overlap_tp.ops.gemm_ar import gemm_ar
from overlap_tp.ops.gemm_rs import gemm_rs
from overlap_tp import tune  # noqa: F401  (registers the tuner as the op layer's resolver of method='auto')

__all__ = ["OverlapConfig", "ag_gemm", "gemm_rs", "gemm_ar", "a2a_gemm", "gemm_a2a"]
__version__ = "0.1.0"
