"""The reduce-scatter's slot sum (kernels/sum_slots.py) against its torch reference in the Triton CPU interpreter,
which rounds fp32 -> bf16/fp16 toward zero (the compiled kernel rounds to nearest even): within one unit in the
last place here, bit for bit on the GPU (tests/gpu/test_gemm_rs_gpu.py)."""
import pytest
import torch

from overlap_tp.kernels.sum_slots import BLOCK, SumSlots, reference_sum_slots


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slots, rows, cols", [(2, 3, 40), (1, 5, 8), (3, 17, 96), (4, 2, BLOCK // 2 + 8),
                                               (2, 1, BLOCK + 1)])
def test_sum_slots_equals_the_fp32_sum_rounded_once(dtype, slots, rows, cols):
    gen = torch.Generator().manual_seed(slots * 1000 + rows * cols)
    x = (torch.randn(slots, rows, cols, generator=gen) * 3).to(dtype)
    out = torch.full((rows, cols), float("nan"), dtype=dtype)
    SumSlots(slots, rows * cols)(x.view(slots, -1), out)
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(out, reference_sum_slots(x), rtol=ulp, atol=ulp)
    assert not out.isnan().any()


def test_sum_slots_rejects_a_buffer_of_another_shape():
    op = SumSlots(2, 12)
    with pytest.raises(ValueError, match="built for"):
        op(torch.zeros(2, 10, dtype=torch.bfloat16), torch.zeros(10, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="same dtype"):
        op(torch.zeros(2, 12, dtype=torch.bfloat16), torch.zeros(12, dtype=torch.float16))
