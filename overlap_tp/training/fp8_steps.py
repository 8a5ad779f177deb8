"""FP8 weights quantized once per optimizer step in Megatron's training loop.

`install_fp8_weight_steps()` wraps Megatron's `train_step` (once): before each step it drops the FP8 weight copies
the step's model kept (overlap_tp.megatron.fp8_linear.new_fp8_step: the optimizer has changed the weights since),
and the first time it sees a model chunk it switches that chunk's FP8 layers to keeping their copies for the rest of
the step (keep_fp8_weights_per_step), so that every micro-batch after the first reuses them. Without the hook (a
script of its own) the layers quantize their weights at every call: correct, one pass over each weight more per
micro-batch. Models without FP8 layers pass through unchanged.
"""
import functools
import weakref

__all__ = ["install_fp8_weight_steps"]


def install_fp8_weight_steps(module=None):
    """Wrap `module.train_step` (default: megatron.training.training's) as the module docstring says; idempotent.
    Returns the wrapper. Megatron calls train_step(forward_step_func, data_iterator, model, ...)."""
    from overlap_tp.megatron.fp8_linear import keep_fp8_weights_per_step, new_fp8_step
    if module is None:
        from megatron.training import training as module
    original = module.train_step
    if getattr(original, "_overlap_tp_fp8_steps", False):
        return original
    seen = weakref.WeakSet()   # the model chunks whose FP8 layers keep their copies per step

    @functools.wraps(original)
    def train_step(*a, **kw):
        model = kw["model"] if "model" in kw else a[2]
        chunks = model if isinstance(model, (list, tuple)) else [model]
        for chunk in chunks:
            if chunk not in seen:
                keep_fp8_weights_per_step(chunk)
                seen.add(chunk)
        new_fp8_step(chunks)
        return original(*a, **kw)

    train_step._overlap_tp_fp8_steps = True
    module.train_step = train_step
    return train_step
