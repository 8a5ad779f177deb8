"""Stand-ins for a p2p reduce-scatter's unsummed result, shared by the norm tests on the CPU and on the GPU."""
import torch


class FakeDeferredSum:
    """ops.p2p_reduction.DeferredSum's contract on plain tensors: consume(kernel) runs kernel(slots) once."""

    def __init__(self, slots):
        self.slots, self.calls = slots, 0

    def consume(self, kernel):
        self.calls += 1
        kernel(self.slots)


class DeferringConsumer(torch.autograd.Function):
    """The next column-parallel layer as a norm sees it: identity forward; its backward hands the norm's output gradient
    over as `slots` (a FakeDeferredSum) through the norm's DeferredGrad `link`, returning an unwritten (NaN)
    placeholder, or returns `summed` itself where link is None."""

    @staticmethod
    def forward(ctx, y, link, slots, summed):
        ctx.link, ctx.slots, ctx.summed = link, slots, summed
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.link is None:
            return ctx.summed, None, None, None
        placeholder = torch.full_like(ctx.summed, float("nan"))
        ctx.link.defer(placeholder, FakeDeferredSum(ctx.slots))
        return placeholder, None, None, None
