"""Megatron's TransformerLayer with the attention output, bias-dropout-add and pre-MLP RMSNorm fused.

Megatron's layer runs, after self-attention (x = linear_proj's output, already reduce-scattered back to
the sequence shards under SP):

    hidden = residual + dropout(x + bias)        self_attn_bda      reads x, residual; writes hidden
    normed = RMSNorm(hidden)                     pre_mlp_layernorm  reads hidden; writes normed

`OverlapTransformerLayer` computes both in one kernel (overlap_tp.megatron.norm.fused_add_rmsnorm): one read of
x and residual, one write of each output, and in backward one kernel instead of two. When linear_proj's
reduce-scatter runs on the p2p transport (ops/p2p_reduction.py), x itself is never written: the kernel reads the
t received partials and sums them (one pass over the activation and one launch less): the layer asks linear_proj
to defer its sum (OverlapRowParallelLinear.defer_sum_next) for the span of its attention block, and the fused bda
runs the deferred sum it finds on x. Everything else is
Megatron's own code: the subclass only swaps `self_attn_bda` for a function that runs the fused kernel
and hands its normalized output to the pre-MLP norm (OverlapRMSNorm.hand_over), which returns it instead of
running the norm again. The handover is keyed on the tensor's identity, so a layer whose forward did not come
through the fused bda (or a recompute that re-runs it) never sees a stale result.

The fused path needs what it replaces to be plain: an OverlapRMSNorm as pre_mlp_layernorm, no
cross-attention, no recompute or CPU offload of the pre-MLP norm. Otherwise the layer is Megatron's
TransformerLayer unchanged, and says so once (a warning naming the reason).

The MLP boundary, the same fusion across two layers: Megatron runs this layer's MLP bias-dropout-add, then
the next layer's input_layernorm on its output. Two layers are linked when they are built: Megatron's
TransformerBlock builds its layers one after the other with one config and consecutive layer numbers, and passes
each layer's output straight to the next; the layers built from one block spec share a LayerChain (the layer spec's
params), which links each to the one built before it. The previous layer's `mlp_bda` then runs the fused kernel with the next
layer's norm weight and hands the normalized rows to that norm (OverlapRMSNorm.hand_over), which returns them
instead of normalizing again; fc2's p2p sum is left to the same kernel. Linked at build time, not at the first
forward, so that every forward runs the same kernels: a process's first microbatch included, which is what makes a
run resumed from a checkpoint match the uninterrupted one bit for bit (linking on the first forward left that
microbatch unfused: a bf16-rounding difference in the resumed run's first update). The handover is keyed on the
tensor's identity, so a pipeline stage boundary, a recompute or anything between the layers that makes a new tensor
simply runs the norm. The last layer of a block, whose output goes to the final norm or the next pipeline stage,
keeps Megatron's bda. Not under
Megatron's per-layer CUDA graphs (captured_per_layer): there each layer is a graph of its own, and the rows
handed over would live in the first graph's private memory; one graph over the whole iteration is fine.

Backward, the mirror of the deferred sums: linear_qkv and a dense MLP's linear_fc1 take a norm's output as their
only input, so their dgrad reduce-scatter on the p2p transport leaves its t partials to that norm's backward kernel,
which sums them as it reads them (OverlapColumnParallelLinear.sum_dgrad_in_norm; the norm checks that what reaches it
is the unsummed placeholder, so a second consumer of the norm's output is an error, never a silent read).

Gathered in place (OverlapSettings.gather_in_place): the same two linears own their
gathered input buffers, and every producer of their input (the input norm, the fused attention bda's pre-MLP norm, the
previous layer's fused MLP bda) writes the normalized rows straight into this rank's region there
(OverlapRMSNorm.output_for -> OverlapColumnParallelLinear.input_buffer): no staging copy before the forward's
AllGather+GEMM, and no re-gather in the backward. Not with activation recomputation, pipeline parallelism (several
micro-batches' gathered inputs alive at once) or CPU offloading; the layer says why once (a warning).

With gathering in place and OverlapSettings.defer_wgrad, linear_fc1's backward leaves its
weight-gradient GEMM to linear_proj's backward, which runs it between its dgrad AllGather's start and its GEMM, so
that proj's pulls run beside it (wgrad_handoff.WgradHandoff).

The token split (OverlapSettings.token_split, in the expert config file; as TokenWeave / Domino,
docs/fused_block.md): a micro-batch of b >= 2 sequences (b even) runs as two halves of b/2 sequences, A and B, in an
order that puts one half's transfers beside the other half's compute:

    input norm A, input norm B          (the norms write into linear_qkv's gathered buffers of plan instance 0 / 1)
    attention A, attention B            (B's qkv GEMM and attention run while A's proj partials are pushed)
    bda + pre-MLP norm A, then B        (each sums its own proj partials)
    MLP A, MLP B                        (B's MLP runs while A's fc2 partials are pushed)
    MLP bda A, then B                   (linked: the next layer's input norms)

Each half's ops run their own plans (the linears' plan_instance), so both halves' calls of one shape can be in flight.
Autograd runs the backward in the reverse order of the forward's records, so the backward interleaves the same way:
MLP B, MLP A (fc1 B's dgrad partials pushed beside MLP A's backward), the bdas, attention B, attention A. Splitting
the batch keeps every half exact (attention never mixes sequences), so the split layer computes what the unsplit
one does, up to the GEMMs' summation order on half the rows. The output is the halves concatenated; a split layer
that follows takes the halves themselves (no copy, and the MLP boundary's handover keyed on each half), except under
Megatron's per-layer CUDA graphs, where each layer's graph gets and returns whole tensors.
"""
import contextlib
import warnings
import weakref
from typing import Optional

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_layer import TransformerLayer

import torch

from overlap_tp.megatron.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear
from overlap_tp.kernels.fp8_quant import BLOCK as FP8_BLOCK
from overlap_tp.megatron.norm import Fp8Output, OverlapRMSNorm, fused_add_rmsnorm
from overlap_tp.megatron.settings import DEFAULT_SETTINGS, OverlapSettings
from overlap_tp.megatron.wgrad_handoff import WgradHandoff

__all__ = ["LayerChain", "OverlapTransformerLayer"]

_warned = set()


def _warn_once(message: str):
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message)
class LayerChain:
    """The OverlapTransformerLayers built from one block spec, in build order (the layer spec's params carry it to
    every layer the spec builds, dense and MoE alike): link(layer) returns the layer built just before it, held
    weakly, or None, and remembers `layer` for the next. OverlapTransformerLayer links the two where they are
    consecutive layers of one block (_link_to_previous_built)."""

    def __init__(self):
        self._last = None

    def __deepcopy__(self, memo):
        """A copy of a layer spec (one per layer, as overlap_tp.bench.reference_spec.gpt_block_spec makes) builds
        layers of the same block: it keeps the chain."""
        return self

    def link(self, layer) -> Optional["OverlapTransformerLayer"]:
        previous = self._last() if self._last is not None else None
        self._last = weakref.ref(layer)
        return previous


def _sum_deferred(linear: OverlapRowParallelLinear, block, defer: bool = True):
    """block() with `linear`'s next p2p reduce-scatter sum left to its output's consumer where `defer`
    (OverlapRowParallelLinear.defer_sum_next): (block's output, the DeferredSum left, or None)."""
    linear.defer_sum_next = defer
    try:
        out = block()
    finally:
        linear.defer_sum_next = False
    deferred, linear.deferred_sum = linear.deferred_sum, None
    return out, deferred


def _summed_by_consumer(linear: OverlapRowParallelLinear, name: str, consumer: str, block):
    """block() with `linear`'s next p2p reduce-scatter sum left to `consumer`, which block() runs; an output that
    reached anything else unsummed is a RuntimeError, never a silent read."""
    out, deferred = _sum_deferred(linear, block)
    _check_summed(deferred, name, consumer)
    return out


def _check_summed(deferred, name: str, consumer: str):
    """A p2p sum left to `consumer` ran there; an output that reached anything else unsummed is an error."""
    if deferred is not None and not deferred.done:
        raise RuntimeError(f"OverlapTransformerLayer: {name}'s output reached something other than {consumer} while "
                           f"its p2p sum was left to that kernel")


def captured_per_layer(config) -> bool:
    """Whether Megatron captures layers (or parts of them) in CUDA graphs of their own: a tensor handed from one
    layer's graph to the next layer's other than through the graphs' inputs and outputs (the MLP boundary's
    normalized rows) would live in the first graph's private memory, which nothing keeps for the second. One
    graph over the whole iteration (cuda_graph_scope full_iteration) holds both layers: no such problem."""
    if getattr(config, "enable_cuda_graph", False) or getattr(config, "external_cuda_graph", False):
        return True
    impl = str(getattr(config, "cuda_graph_impl", "none") or "none")
    if impl in ("none", "full_iteration"):
        return False
    scope = getattr(config, "cuda_graph_scope", None) or []
    scope = scope if isinstance(scope, (list, tuple)) else [scope]
    return not (impl == "local" and any(str(getattr(s, "name", s)) == "full_iteration" for s in scope))


class OverlapTransformerLayer(TransformerLayer):
    """TransformerLayer whose self-attention bias-dropout-add and pre-MLP RMSNorm run as one kernel."""

    def __init__(self, *args, settings: Optional[OverlapSettings] = None, chain: Optional[LayerChain] = None,
                 **kwargs):
        """settings: gather_in_place, defer_wgrad and token_split are read here (the layer spec passes the same
        OverlapSettings to the layer and to its linears); chain: the LayerChain of the block spec this layer is built
        from (None: the layer links to no other, its MLP boundary unfused)."""
        super().__init__(*args, **kwargs)
        if settings is not None and not isinstance(settings, OverlapSettings):
            raise TypeError(f"OverlapTransformerLayer: settings must be an OverlapSettings, got "
                            f"{type(settings).__name__}")
        self.settings = settings = settings if settings is not None else DEFAULT_SETTINGS
        reason = self._unfusable_reason()
        self.fused_attn_norm = reason is None
        proj = getattr(self.self_attention, "linear_proj", None)
        # linear_proj's p2p sum summed by the fused kernel (offloading would copy its unwritten output)
        self.fused_proj_sum = (self.fused_attn_norm and isinstance(proj, OverlapRowParallelLinear)
                               and proj.sequence_parallel and not getattr(self.self_attention, "offload_attn_proj",
                                                                          False))
        if self.fused_attn_norm:
            self.self_attn_bda = self._fused_attn_bda
        elif reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"OverlapTransformerLayer: running Megatron's separate bias-dropout-add and pre-MLP "
                          f"norm because {reason}")
        # the MLP boundary: this layer's mlp bda runs the next layer's input norm once they are linked
        self.next_input_norm = None
        self.fused_mlp_boundary = (self.fused_attn_norm and not getattr(self, "offload_mlp_norm", False)
                                   and not captured_per_layer(self.config))
        if self.fused_mlp_boundary:
            self._megatron_mlp_bda = self.mlp_bda
            self.mlp_bda = self._fused_mlp_bda
        self.fused_fc2_sum = True      # with the next norm linked, fc2's p2p sum is left to the fused mlp bda
        # ... and this layer's input norm takes the previous layer's handover
        self.takes_input_handover = (type(self.input_layernorm) is OverlapRMSNorm
                                     and not getattr(self, "recompute_input_layernorm", False)
                                     and not getattr(self, "offload_attn_norm", False))
        self.chain = chain
        self._link_to_previous_built()
        # the backward mirror: the column-parallel layers whose input is a norm's output and nothing else's (qkv, a
        # dense MLP's fc1) leave their dgrad's p2p sum to that norm's backward kernel
        for linear in (getattr(self.self_attention, "linear_qkv", None),
                       getattr(self.mlp, "linear_fc1", None) if type(self.mlp) is MLP else None):
            if isinstance(linear, OverlapColumnParallelLinear):
                linear.sum_dgrad_in_norm = True
        if settings.gather_in_place:
            self._gather_inputs_in_place()
        self._quantize_inputs_in_norms()
        self.token_split = False
        if settings.token_split:
            reason = self._unsplittable_reason()
            if reason is None:
                self.token_split = True
            else:
                _warn_once(f"OverlapTransformerLayer: token-split is off because {reason}; the layer "
                           f"runs each micro-batch whole")

    def _unsplittable_reason(self) -> Optional[str]:
        """Why this layer cannot run the token split (None: it can). The split forward runs the plain layer: the
        fused attention bda, a dense MLP, sequence parallelism, nothing recomputed or offloaded."""
        config = self.config
        if not self.fused_attn_norm:
            return "the attention bda and pre-MLP norm are not fused here"
        if type(self.mlp) is not MLP:
            return f"the MLP is {type(self.mlp).__name__}, not a dense MLP"
        if not getattr(config, "sequence_parallel", False):
            return "sequence parallelism is off (no transfer to hide)"
        if getattr(config, "recompute_granularity", None) is not None or getattr(self, "recompute_mlp", False) \
                or getattr(self, "recompute_input_layernorm", False):
            return "activations are recomputed"
        if getattr(config, "cpu_offloading", False) or getattr(config, "fine_grained_activation_offloading", False):
            return "activations are offloaded to the CPU"
        if getattr(config, "mlp_chunks_for_training", 1) > 1:
            return "config.mlp_chunks_for_training chunks the MLP already"
        return None

    def _gather_inputs_in_place(self):
        """linear_qkv and a dense MLP's linear_fc1 gather their inputs in their own buffers, written by their norms
        (the module docstring); a reason not to is warned once."""
        config = self.config
        reason = None
        if not getattr(config, "sequence_parallel", False):
            reason = "sequence parallelism is off (nothing is gathered)"
        elif getattr(config, "recompute_granularity", None) is not None:
            reason = "activations are recomputed (a recomputed forward would rewrite a buffer the backward still reads)"
        elif getattr(config, "pipeline_model_parallel_size", 1) > 1:
            reason = "pipeline parallelism keeps several micro-batches' gathered inputs alive at once"
        elif getattr(config, "cpu_offloading", False) or getattr(config, "fine_grained_activation_offloading", False):
            reason = "activations are offloaded to the CPU"
        elif getattr(config, "fp8", None):
            reason = ("the linears run FP8 (their AllGathers move the quantized rows, not the norm's output; "
                      "overlap_tp.megatron.fp8_linear)")
        if reason is not None:
            if reason not in _warned:
                _warned.add(reason)
                warnings.warn(f"OverlapTransformerLayer: gather-in-place is off because {reason}; the "
                              f"AllGathers stage their inputs and the backward re-gathers them")
            return
        pairs = self._norm_fed_linears()
        for norm, linear in pairs:
            if type(norm) is OverlapRMSNorm and isinstance(linear, OverlapColumnParallelLinear):
                linear.gather_in_place = True
                norm.output_for = linear.input_buffer
        fc1, proj = pairs[1][1], getattr(self.self_attention, "linear_proj", None)
        if (self.settings.defer_wgrad and fc1 is not None and fc1.gather_in_place
                and isinstance(proj, OverlapRowParallelLinear) and proj.sequence_parallel):
            # fc1's wgrad runs beside proj's dgrad AllGather (WgradHandoff): fc1's backward leaves it, proj's takes it
            fc1.wgrad_handoff = proj.wgrad_handoff = WgradHandoff(fc1)

    def _norm_fed_linears(self):
        """(norm, column-parallel linear) where the linear's input is the norm's output and nothing else's:
        (input_layernorm, linear_qkv) and, with a dense MLP, (pre_mlp_layernorm, linear_fc1)."""
        return ((self.input_layernorm, getattr(self.self_attention, "linear_qkv", None)),
                (self.pre_mlp_layernorm, getattr(self.mlp, "linear_fc1", None) if type(self.mlp) is MLP else None))

    def _quantize_inputs_in_norms(self):
        """An FP8 linear_qkv / dense linear_fc1 fed by an OverlapRMSNorm takes its input's FP8 copy from that norm's
        pass (norm.py, fp8_output; bit-equal to quantizing it in the linear, one pass over the rows less)."""
        for norm, linear in self._norm_fed_linears():
            recipe = getattr(linear, "fp8", None)
            if (type(norm) is OverlapRMSNorm and isinstance(linear, OverlapColumnParallelLinear)
                    and recipe is not None and linear.sequence_parallel
                    and (recipe.row_scaling != "1x128" or linear.input_size % FP8_BLOCK == 0)):
                norm.fp8_output = Fp8Output(recipe.forward_format, recipe.row_scaling)

    def _unfusable_reason(self) -> Optional[str]:
        if type(self.pre_mlp_layernorm) is not OverlapRMSNorm:
            return f"pre_mlp_layernorm is {type(self.pre_mlp_layernorm).__name__}, not OverlapRMSNorm"
        if not isinstance(self.cross_attention, IdentityOp) or not isinstance(self.pre_cross_attn_layernorm,
                                                                              IdentityOp):
            return "the layer has cross-attention (the bda's output is not the pre-MLP norm's input)"
        if getattr(self, "recompute_pre_mlp_layernorm", False):
            return "the pre-MLP norm is recomputed (recompute_modules includes 'layernorm')"
        if getattr(self, "offload_mlp_norm", False) or getattr(self, "offload_attn_norm", False):
            return "norm activations are offloaded to the CPU"
        if getattr(self.config, "inference_fuse_tp_communication", False):
            return "config.inference_fuse_tp_communication fuses the residual into linear_proj instead"
        return None

    def _fused_attn_bda(self, training: bool, fused: bool):
        """Stands in for `get_bias_dropout_add(training, fused)`: returns Megatron's bda signature."""
        norm = self.pre_mlp_layernorm

        def bias_dropout_add_norm(x_with_bias, residual, prob):
            x, bias = x_with_bias
            x_sum = getattr(x, "overlap_tp_deferred_sum", None)   # linear_proj left its p2p sum to this kernel
            if x_sum is not None:
                del x.overlap_tp_deferred_sum
            # Megatron's TransformerLayer ignores apply_residual_connection_post_layernorm: so do we.
            normed, hidden = fused_add_rmsnorm(
                x, residual, norm.weight, bias, eps=norm.eps, zero_centered_gamma=norm.zero_centered_gamma,
                dropout_p=prob, training=training, fp32_residual=self.config.fp32_residual_connection, x_sum=x_sum,
                y_out=norm.output_buffer(residual.shape, x.dtype, x.device), fp8=norm.fp8_output)
            norm.hand_over(hidden, normed)
            return hidden

        return bias_dropout_add_norm

    def _forward_attention(self, *args, **kwargs):
        """Megatron's attention block (self-attention, then the bda), with linear_proj's p2p sum deferred to the
        fused bda's kernel when the layer fuses them; an output left unsummed is an error, never a silent read."""
        if not self.fused_proj_sum:
            return super()._forward_attention(*args, **kwargs)
        return _summed_by_consumer(self.self_attention.linear_proj, "linear_proj", "the fused bias-dropout-add + norm",
                                   lambda: super(OverlapTransformerLayer, self)._forward_attention(*args, **kwargs))

    def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None, rotary_pos_emb=None,
                **kwargs):
        """Megatron's forward, or with the token split (self.token_split) the two halves interleaved (the module
        docstring) where this call allows it: b even, training or evaluation without inference state or packed
        sequences; otherwise Megatron's forward, with a warning naming why (once)."""
        reason = self._split_call_reason(hidden_states, context, kwargs) if self.token_split else "off"
        if reason is not None:
            if reason != "off":
                _warn_once(f"OverlapTransformerLayer: the token split does not run here because {reason}; the layer "
                           f"runs the micro-batch whole")
            return super().forward(hidden_states, attention_mask=attention_mask, context=context,
                                   context_mask=context_mask, rotary_pos_emb=rotary_pos_emb, **kwargs)
        return self._split_forward(hidden_states, attention_mask, rotary_pos_emb), None

    def _split_call_reason(self, hidden_states, context, kwargs) -> Optional[str]:
        if hidden_states.dim() != 3 or hidden_states.shape[1] % 2:
            return f"the micro-batch has {hidden_states.shape[1]} sequences (the split needs an even number)"
        if context is not None:
            return "a cross-attention context was given"
        if kwargs.get("inference_context") is not None or kwargs.get("inference_params") is not None:
            return "it runs inference"
        for name in ("packed_seq_params", "attention_bias", "rotary_pos_cos", "rotary_pos_sin",
                     "rotary_pos_cos_sin", "sequence_len_offset"):
            if kwargs.get(name) is not None:
                return f"{name} was given"
        return None

    def _halves(self, hidden_states):
        """The two halves of the micro-batch: the previous split layer's own outputs where it handed them on (not
        under per-layer graphs), else contiguous copies of hidden_states[:, :b/2] and [:, b/2:]."""
        halves = getattr(hidden_states, "overlap_tp_halves", None)
        b = hidden_states.shape[1]
        if (halves is not None and len(halves) == 2
                and all(h.shape == (hidden_states.shape[0], b // 2, hidden_states.shape[2]) for h in halves)):
            return halves
        return tuple(h.contiguous() for h in hidden_states.chunk(2, dim=1))

    def _split_forward(self, hidden_states, attention_mask, rotary_pos_emb):
        halves = self._halves(hidden_states)
        b = hidden_states.shape[1]
        masks = ((None, None) if attention_mask is None else attention_mask.chunk(2, dim=0)
                 if attention_mask.shape[0] == b else (attention_mask, attention_mask))
        proj = self.self_attention.linear_proj
        fc2 = self.mlp.linear_fc2
        # fc2's p2p sum waits for the MLP bda either way: the fused kernel sums it (linked), else it is summed into
        # fc2's output just before Megatron's bda, after the other half's MLP was issued
        defer_fc2 = isinstance(fc2, OverlapRowParallelLinear) and fc2.sequence_parallel
        fused_fc2 = self.linked_next_norm() is not None and self.fused_fc2_sum
        fp32_residual = self.config.fp32_residual_connection
        normed = []
        for i, h in enumerate(halves):
            with self._half(i):
                normed.append(self.input_layernorm(h))
        attention = []   # (output with bias, what linear_proj left to the bda)
        for i in range(2):
            with self._half(i):
                attention.append(_sum_deferred(proj, lambda: self.self_attention(
                    normed[i], attention_mask=masks[i], rotary_pos_emb=rotary_pos_emb), self.fused_proj_sum))
        mids = []
        for i, h in enumerate(halves):
            with self._half(i), self.bias_dropout_add_exec_handler():
                residual = h.float() if fp32_residual else h
                mids.append(self.self_attn_bda(self.training, self.config.bias_dropout_fusion)(
                    attention[i][0], residual, self.hidden_dropout))
            _check_summed(attention[i][1], "linear_proj", "the fused bias-dropout-add + norm")
        mlp = []   # (output with bias, what linear_fc2 left to the MLP bda)
        for i in range(2):
            with self._half(i):
                mlp.append(_sum_deferred(fc2, lambda: self.mlp(self.pre_mlp_layernorm(mids[i])), defer_fc2))
        outs = []
        for i in range(2):
            x, deferred = mlp[i][0][0], mlp[i][1]
            if deferred is not None and not fused_fc2 and getattr(x, "overlap_tp_deferred_sum", None) is deferred:
                del x.overlap_tp_deferred_sum
                with torch.no_grad():   # the values of fc2's output in autograd, written by the kernel, not recorded
                    deferred.into(x.view(-1, x.shape[-1]))
            with self._half(i), self.bias_dropout_add_exec_handler():
                residual = mids[i].float() if fp32_residual else mids[i]
                outs.append(self.mlp_bda(self.training, self.config.bias_dropout_fusion)(
                    mlp[i][0], residual, self.hidden_dropout))
            _check_summed(mlp[i][1], "linear_fc2", "the fused bias-dropout-add + next norm")
        output = torch.cat(outs, dim=1)
        if not captured_per_layer(self.config):
            output.overlap_tp_halves = tuple(outs)   # for the next split layer (_halves)
        return output

    @contextlib.contextmanager
    def _half(self, i: int):
        """The block runs half i's ops on plan instance i (OverlapColumnParallelLinear.plan_instance): this layer's
        linears and the linear whose gathered buffer the linked next input norm writes (the MLP bda hands half i's
        rows over into the next layer's buffer of instance i). Instance 0 is back after the block."""
        linears = [m for m in self.modules() if isinstance(m, (OverlapColumnParallelLinear, OverlapRowParallelLinear))]
        consumer = getattr(getattr(self.linked_next_norm(), "output_for", None), "__self__", None)
        if isinstance(consumer, OverlapColumnParallelLinear):
            linears.append(consumer)
        for linear in linears:
            linear.plan_instance = i
        try:
            yield
        finally:
            for linear in linears:
                linear.plan_instance = 0

    def _link_to_previous_built(self):
        """Links the layer built just before this one to this layer's input norm when both are consecutive layers
        of one block: the same config object and the next layer number (TransformerBlock builds its layers in
        order; virtual pipeline chunks, separate models and the next pipeline stage fail one of the two). Never an
        MTP layer: each is fed through its own projection, and MTP layers are numbered 1, 2, ... of their own."""
        if self.chain is None:
            return
        previous = self.chain.link(self)
        if (previous is not None and previous.config is self.config and previous.layer_number + 1 == self.layer_number
                and previous.fused_mlp_boundary and self.takes_input_handover
                and not getattr(previous, "is_mtp_layer", False) and not getattr(self, "is_mtp_layer", False)):
            # a plain attribute: assigned as a Module it would become the previous layer's submodule (its weight in
            # that layer's parameters and state dict too)
            object.__setattr__(previous, "next_input_norm", self.input_layernorm)

    def linked_next_norm(self):
        """The next layer's input norm that this layer's mlp bda runs, or None (unlinked, or the boundary turned
        off after the build)."""
        return self.next_input_norm if self.fused_mlp_boundary else None

    def _fused_mlp_bda(self, training: bool, fused: bool):
        """Stands in for `get_bias_dropout_add(training, fused)` as mlp_bda: with the next layer's input norm
        linked, the fused kernel (which also sums fc2's deferred p2p partials), handing the normalized rows over
        to that norm; else Megatron's bda."""
        def bias_dropout_add_next_norm(x_with_bias, residual, prob):
            x, bias = x_with_bias
            x_sum = getattr(x, "overlap_tp_deferred_sum", None)   # fc2 left its p2p sum to this kernel
            if x_sum is not None:
                del x.overlap_tp_deferred_sum
            norm = self.linked_next_norm()
            if norm is None:
                return self._megatron_mlp_bda(training, fused)(x_with_bias, residual, prob)
            normed, hidden = fused_add_rmsnorm(
                x, residual, norm.weight, bias, eps=norm.eps, zero_centered_gamma=norm.zero_centered_gamma,
                dropout_p=prob, training=training, fp32_residual=self.config.fp32_residual_connection, x_sum=x_sum,
                y_out=norm.output_buffer(residual.shape, x.dtype, x.device), fp8=norm.fp8_output)
            norm.hand_over(hidden, normed)
            return hidden

        return bias_dropout_add_next_norm

    def _forward_mlp(self, *args, **kwargs):
        """Megatron's MLP block, with fc2's p2p sum deferred to the fused mlp bda when the next layer is linked;
        an output left unsummed is an error, never a silent read."""
        fc2 = getattr(self.mlp, "linear_fc2", None)
        if (self.linked_next_norm() is None or not self.fused_fc2_sum or not isinstance(fc2, OverlapRowParallelLinear)
                or not fc2.sequence_parallel or getattr(self, "recompute_mlp", False)):
            return super()._forward_mlp(*args, **kwargs)
        return _summed_by_consumer(fc2, "linear_fc2", "the fused bias-dropout-add + next norm",
                                   lambda: super(OverlapTransformerLayer, self)._forward_mlp(*args, **kwargs))
