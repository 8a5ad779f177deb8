"""A one-thread Triton kernel that blocks its stream until a counter reaches a target.

The fallback for the comm stream's wait where CUDA stream memory operations (cuStreamWaitValue32)
are not available. It occupies one SM while it spins, which is why the GEMM grid leaves comm_sms free.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def spin_wait_kernel(counter_ptr, target):
    # Cyclic comparison, like CU_STREAM_WAIT_VALUE_GEQ: (int32)(value - target) >= 0 ignores wrap-around.
    # The acquire pairs with the GEMM epilogue's release, so work behind this kernel sees the tiles.
    value = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while value - target < 0:
        value = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")


def spin_wait(counters: torch.Tensor, index: int, target: int):
    """Enqueue on the current stream: wait until counters[index] reaches target (mod 2**32)."""
    signed_target = ((target & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000
    spin_wait_kernel[(1,)](counters[index:], signed_target, num_warps=1)
