"""Megatron's process groups, looked up without making megatron-core a hard dependency."""


def megatron_tp_group():
    """Megatron's tensor-model-parallel group if megatron-core is importable and initialized, else None."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()
