"""WgradHandoff: a column-parallel layer's weight-gradient GEMM left to the row-parallel layer whose backward autograd
runs after it (OverlapTransformerLayer's linear_fc1 and linear_proj, OverlapSettings.defer_wgrad)."""
from typing import Callable, Optional

import torch


class WgradHandoff:
    """A column-parallel layer's weight-gradient GEMM left to a row-parallel layer's backward that autograd runs after
    it, to run between that backward's AllGather start and its GEMM (AgGemm.start/finish): one layer's linear_fc1 and
    linear_proj (OverlapTransformerLayer, OverlapSettings.defer_wgrad).

    Why: in a layer's backward, linear_proj's dgrad AllGather+GEMM waits for the pre-MLP norm's backward, which waits
    for fc1's dgrad; its pulls (at TP 4 longer than proj's short dgrad GEMM) would have nothing to run beside. fc1's
    wgrad GEMM (longer than those pulls) depends on neither, so it moves there: under a CUDA graph the copy engines
    pull proj's rows while the SMs run fc1's wgrad, and proj's dgrad GEMM then finds its rows in place
    (docs/performance.md). Eagerly, with one hardware queue, the wgrad's launch waits
    behind the pulls enqueued before it (AgGemm.start), so the move pays under graphs only.

    How the gradient gets home: fc1's weight is also an input of proj's autograd Function (`consumer_input`, passed at
    proj's forward), so fc1's backward returns no weight gradient and proj's backward returns it, computed by the
    same weight_grad (main_grad accumulation and Megatron's dummy with gradient_accumulation_fusion). Autograd sums
    the two edges and accumulates fc1's weight once, after proj's backward: DDP's hooks, --overlap-grad-reduce and
    the gradient capture of Megatron's CUDA graphs see it as any other weight's. Bit for bit the undeferred path.

    Armed by proj's forward (its backward will run and return fc1's weight gradient); a wgrad left and never taken is
    a RuntimeError at proj's next forward, never a silently missing gradient."""

    __slots__ = ("producer", "armed", "pending")

    def __init__(self, producer: torch.nn.Module):
        self.producer = producer   # the column-parallel layer whose wgrad is left (its .weight is read at each forward)
        self.armed = False         # the consumer's forward took the producer's weight as an input: its backward runs
        self.pending = None        # the wgrad left by the producer's backward: a function returning its gradient

    def consumer_input(self, grad_enabled: bool) -> Optional[torch.Tensor]:
        """At the consumer's forward: the producer's weight, as an extra input of the consumer's Function (None where
        autograd records nothing, or the weight needs no gradient); arms the handoff accordingly."""
        if self.pending is not None:
            raise RuntimeError("overlap_tp: linear_fc1's deferred weight gradient was never run (linear_proj's "
                               "backward did not come after fc1's); turn the deferred wgrad off (layers.defer_wgrad "
                               "false in --overlap-tp-config)")
        weight = getattr(self.producer, "weight", None)
        self.armed = grad_enabled and weight is not None and weight.requires_grad
        return weight if self.armed else None

    def leave(self, wgrad: Callable[[], Optional[torch.Tensor]]) -> bool:
        """Leave `wgrad` (returns the weight's gradient for autograd) to the consumer's backward; False (run it
        yourself) where the consumer's forward did not take the weight."""
        if not self.armed or self.pending is not None:
            return False
        self.pending = wgrad
        return True

    def take(self) -> Optional[Callable[[], Optional[torch.Tensor]]]:
        wgrad, self.pending = self.pending, None
        return wgrad
