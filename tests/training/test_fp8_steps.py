"""The FP8 weight-step hook: each train_step first drops the step's model's kept FP8 weight copies, and a model chunk
seen for the first time keeps its copies per step from then on; the hook wraps once."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core", reason="the FP8 layers need megatron-core")

from overlap_tp.megatron.fp8_linear import Fp8Recipe, Fp8WeightCache  # noqa: E402
from overlap_tp.training.fp8_steps import install_fp8_weight_steps  # noqa: E402


class _Fp8Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fp8_weights = Fp8WeightCache()


def test_each_step_drops_the_kept_copies_and_a_new_model_keeps_them():
    calls = []
    module = SimpleNamespace(train_step=lambda *a, **kw: calls.append((a, kw)) or "stepped")
    wrapper = install_fp8_weight_steps(module)
    assert install_fp8_weight_steps(module) is wrapper and module.train_step is wrapper   # once
    layer = _Fp8Layer()
    model = [torch.nn.Sequential(torch.nn.Linear(2, 2), layer)]
    assert layer.fp8_weights.per_step is False
    assert module.train_step(None, None, model, iteration=0) == "stepped" and len(calls) == 1
    assert layer.fp8_weights.per_step is True
    weight = torch.randn(256, 256)
    recipe = Fp8Recipe("e4m3", "tensorwise")
    kept = layer.fp8_weights.get(weight, recipe)
    assert layer.fp8_weights.get(weight, recipe) is kept          # the step's later micro-batches reuse it
    module.train_step(None, None, model=model, iteration=1)        # the next step: the weights changed
    assert layer.fp8_weights.get(weight, recipe) is not kept


def test_a_cache_not_kept_per_step_quantizes_every_call():
    cache = Fp8WeightCache()
    weight = torch.randn(256, 256)
    recipe = Fp8Recipe("hybrid", "blockwise")
    first, second = cache.get(weight, recipe), cache.get(weight, recipe)
    assert first is not second and torch.equal(first[0].q.view(torch.uint8), second[0].q.view(torch.uint8))
    cache.per_step = True
    kept = cache.get(weight, recipe)
    assert cache.get(weight, recipe) is kept
    assert cache.get(weight.clone(), recipe) is not kept            # another tensor: quantized afresh
