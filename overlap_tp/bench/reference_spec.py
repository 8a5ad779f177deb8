"""The Megatron reference that overlap_tp's layers are measured and checked against, and the
no-communication counterfactual of it.

    get_gpt_layer_megatron_reference_spec(...)   Megatron's own get_gpt_layer_local_spec(normalization=
                                                 "RMSNorm") with ONLY the modules Megatron's local spec
                                                 cannot run here swapped for overlap_tp's (see below)
    gpt_block_spec(layer_spec, num_layers)       a TransformerBlockSubmodules with OverlapRMSNorm as the
                                                 final norm (for GPTModel, either spec)
    no_tp_communication()                        context manager: every TP collective of Megatron's
                                                 linears replaced by a shape-equivalent local op
    count_collectives()                          context manager: counts torch.distributed collective
                                                 calls (proves the counterfactual has none left)
    megatron_sp_on_cpu()                         context manager: lets Megatron's sequence-parallel code
                                                 run on CPU tensors (gloo tests and `--device cpu` only)

What the reference spec changes in `get_gpt_layer_local_spec(qk_layernorm=..., normalization="RMSNorm")`
(megatron-core 0.16-0.19), and why:

| slot | local spec | reference | why |
|---|---|---|---|
| input_layernorm, pre_mlp_layernorm | WrappedTorchNorm | OverlapRMSNorm | WrappedTorchNorm refuses sequence parallel |
| q_layernorm, k_layernorm (qk_layernorm=True) | WrappedTorchNorm | OverlapQKRMSNorm | the same module as ours |
| self_attention.core_attention | DotProductAttention | SDPAttention (TEDotProductAttention with TE) | no fused attention in the local spec; the same module as ours |

Everything else is Megatron's, untouched: `TransformerLayer` (separate bias-dropout-add and pre-MLP
norm, where our spec's OverlapTransformerLayer fuses them), `SelfAttention`, `MLP`,
`ColumnParallelLinear` / `RowParallelLinear` for linear_qkv / linear_proj / linear_fc1 / linear_fc2,
`get_bias_dropout_add`, the sharded-state-dict key map. So the reference differs from
`get_gpt_layer_overlap_spec` exactly in the linears and the (unfused) bda + pre-MLP norm.

The counterfactual (`no_tp_communication`) patches, for the duration only, the module globals through
which Megatron's linears communicate, in `megatron.core.tensor_parallel.layers` and `.mappings`:
`dist_all_gather_func` (all-gather -> the local shard repeated t times into the same output buffer),
`dist_reduce_scatter_func` (reduce-scatter -> this rank's slice copied into the same output buffer) and
`mappings._reduce` (all-reduce -> identity). Megatron's own code keeps allocating its buffers and
running its GEMMs on the same shapes; only the bytes between GPUs are gone. It covers the sequence-parallel
paths of ColumnParallelLinear / RowParallelLinear (forward and backward) and the forward all-reduce
of the non-SP row layer; the non-SP column dgrad all-reduce, which Megatron calls as
`torch.distributed.all_reduce` directly, is not replaced (`count_collectives` would show it).
"""
import contextlib
import copy
from typing import Dict, Optional

import torch
import torch.distributed as dist

__all__ = ["count_collectives", "get_gpt_layer_megatron_reference_spec", "gpt_block_spec", "megatron_sp_on_cpu",
           "no_tp_communication"]


def get_gpt_layer_megatron_reference_spec(qk_layernorm: bool = False, qk_l2_norm: bool = False,
                                          multi_latent_attention: bool = False, **unused_kwargs):
    """Megatron's local TransformerLayer spec with RMSNorm, made runnable with sequence parallel and
    without Transformer Engine / Apex: the norms become OverlapRMSNorm (OverlapQKRMSNorm for q/k, and for
    MLA's q / kv latent norms) and the core attention overlap_tp's (SDPAttention, or TEDotProductAttention
    where TE imports). The linears, the layer class and everything else stay Megatron's (module docstring);
    with multi_latent_attention, Megatron's MLASelfAttention on its ColumnParallelLinear / RowParallelLinear."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.torch_norm import L2Norm

    from overlap_tp.megatron.attention import core_attention_module
    from overlap_tp.megatron.layer_spec import OverlapQKRMSNorm
    from overlap_tp.megatron.norm import OverlapRMSNorm

    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm", qk_l2_norm=qk_l2_norm,
                                    multi_latent_attention=multi_latent_attention)
    spec = copy.copy(spec)
    sub = spec.submodules = copy.copy(spec.submodules)
    sub.input_layernorm = OverlapRMSNorm
    sub.pre_mlp_layernorm = OverlapRMSNorm
    attention = sub.self_attention = copy.copy(sub.self_attention)
    attn = attention.submodules = copy.copy(attention.submodules)
    attn.core_attention = core_attention_module()
    for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):
        if getattr(attn, name, None) not in (IdentityOp, L2Norm, None):
            setattr(attn, name, OverlapQKRMSNorm)
    return spec


def gpt_block_spec(layer_spec, num_layers: int):
    """`num_layers` copies of `layer_spec` with OverlapRMSNorm as the block's final norm: given a bare
    layer spec, Megatron picks the final norm itself, and without TE or Apex that is WrappedTorchNorm,
    which refuses sequence parallel. Each layer gets its own copy of the spec (megatron-core 0.19
    rewrites a layer spec's `mlp` entry in place while building)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from overlap_tp.megatron.norm import OverlapRMSNorm
    return TransformerBlockSubmodules(layer_specs=[copy.deepcopy(layer_spec) for _ in range(num_layers)],
                                      layer_norm=OverlapRMSNorm)


# ---------------------------------------------------------------------------------------------------
# The no-communication counterfactual
# ---------------------------------------------------------------------------------------------------

class _Done:
    """What an async torch.distributed call returns, for a local op that is already finished."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


def _group_rank_size(group):
    if group is None:
        return dist.get_rank(), dist.get_world_size()
    return group.rank(), group.size()


def local_all_gather(output, input_, group=None, async_op=False, **unused):
    """all_gather_into_tensor without communication: this rank's shard repeated t times, same buffer."""
    _, t = _group_rank_size(group)
    output.view(t, *input_.shape).copy_(input_.unsqueeze(0).expand(t, *input_.shape))
    return _Done() if async_op else None


def local_reduce_scatter(output, input_, group=None, async_op=False, **unused):
    """reduce_scatter_tensor without communication: this rank's slice of the input, same buffer."""
    rank, _ = _group_rank_size(group)
    rows = output.shape[0]
    output.copy_(input_.narrow(0, rank * rows, rows).view_as(output))
    return _Done() if async_op else None


def _local_reduce(input_, group=None, *args, **kwargs):
    """all-reduce without communication: the identity."""
    return input_


def _modules():
    from megatron.core.tensor_parallel import layers, mappings
    return layers, mappings


@contextlib.contextmanager
def _patched(targets):
    """Set module attributes for the duration; restore whatever was there before (nesting-safe)."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in targets]
    try:
        for module, name, value in targets:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


@contextlib.contextmanager
def no_tp_communication():
    """Megatron's linears with every TP collective of the sequence-parallel paths (and the forward
    all-reduce) replaced by a local op of the same output shape, in the same buffers (module
    docstring). Restores the originals on exit."""
    layers, mappings = _modules()
    with _patched([(layers, "dist_all_gather_func", local_all_gather),
                   (layers, "dist_reduce_scatter_func", local_reduce_scatter),
                   (mappings, "dist_all_gather_func", local_all_gather),
                   (mappings, "dist_reduce_scatter_func", local_reduce_scatter),
                   (mappings, "_reduce", _local_reduce)]):
        yield


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
               "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all_single", "all_to_all", "broadcast",
               "send", "recv", "isend", "irecv", "batch_isend_irecv")


@contextlib.contextmanager
def count_collectives():
    """Yields a dict {name: calls} counting the torch.distributed collectives called inside, including
    those Megatron reaches through its module globals (dist_all_gather_func / dist_reduce_scatter_func of
    tensor_parallel.layers and .mappings). Enter it outside `no_tp_communication`."""
    counts: Dict[str, int] = {}

    def spy(name, fn):
        def counted(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)
        counted.overlap_tp_spy = True
        return counted

    layers, mappings = _modules()
    targets = [(dist, name, spy(name, getattr(dist, name))) for name in COLLECTIVES if hasattr(dist, name)]
    for module in (layers, mappings):
        for name in ("dist_all_gather_func", "dist_reduce_scatter_func"):
            if hasattr(module, name):
                targets.append((module, name, spy(f"{module.__name__.rsplit('.', 1)[-1]}.{name}",
                                                  getattr(module, name))))
    with _patched(targets):
        yield counts


# ---------------------------------------------------------------------------------------------------
# CPU runs of Megatron's sequence-parallel code (tests, `--device cpu`)
# ---------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def megatron_sp_on_cpu(active: Optional[bool] = None):
    """Megatron's sequence-parallel linears allocate their gather / reduce-scatter buffers on
    `torch.cuda.current_device()`, the sequence-parallel embedding forks the CUDA RNG tracker and
    dist_checkpointing's save calls torch.cuda.synchronize. On a machine without CUDA, make the first
    the CPU and the other two no-ops for the duration, so the reference (and a GPTModel, and its
    checkpoint) runs under gloo. Does nothing where CUDA is available (or `active=False`). For tests
    and `--device cpu` plumbing runs only: it patches torch.cuda process-wide."""
    if active is None:
        active = not torch.cuda.is_available()
    if not active:
        yield
        return
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    tracker = get_cuda_rng_tracker()
    with _patched([(torch.cuda, "current_device", lambda: torch.device("cpu")),
                   (torch.cuda, "synchronize", lambda *args, **kwargs: None),   # dist_checkpointing.save
                   # the sequence-parallel embedding forks the CUDA RNG tracker for its dropout
                   (tracker, "fork", lambda *args, **kwargs: contextlib.nullcontext())]):
        yield
