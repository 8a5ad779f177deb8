"""Transformer Engine and overlap_tp's spec, on CPU with a stand-in TE module tree (TE cannot be installed
here): with --transformer-impl transformer_engine and TE importable, TE's core attention, q/k norms and final
norm are taken, and overlap_tp's modules stay where TP communication happens (qkv, proj, fc1, fc2 and the
norms fused in front of them); with the local impl, or without TE, none of TE's modules appear."""
import sys
import types
from types import SimpleNamespace

import pytest

pytest.importorskip("megatron.core", reason="the layer spec needs megatron-core")

from megatron.core.transformer import transformer_block  # noqa: E402

from overlap_tp.megatron.attention import SDPAttention  # noqa: E402
from overlap_tp.megatron.layer_spec import OverlapQKRMSNorm, get_gpt_layer_overlap_spec  # noqa: E402
from overlap_tp.megatron.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear  # noqa: E402
from overlap_tp.megatron.norm import OverlapRMSNorm  # noqa: E402
from overlap_tp.megatron_patches import apply as patches  # noqa: E402


class TEDotProductAttention:
    """stand-in"""


class TENorm:
    """stand-in"""


@pytest.fixture
def with_te(monkeypatch):
    """`import transformer_engine` works and Megatron's TE extension module holds the stand-ins."""
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    extension = types.ModuleType("megatron.core.extensions.transformer_engine")
    extension.TEDotProductAttention, extension.TENorm, extension.HAVE_TE = TEDotProductAttention, TENorm, True
    monkeypatch.setitem(sys.modules, "megatron.core.extensions.transformer_engine", extension)


@pytest.fixture
def without_te(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)   # import raises ImportError


def slots(spec):
    attention = spec.submodules.self_attention.submodules
    mlp = spec.submodules.mlp.submodules
    return {"input_layernorm": spec.submodules.input_layernorm, "pre_mlp_layernorm": spec.submodules.pre_mlp_layernorm,
            "linear_qkv": attention.linear_qkv, "linear_proj": attention.linear_proj,
            "core_attention": attention.core_attention, "q_layernorm": attention.q_layernorm,
            "k_layernorm": attention.k_layernorm, "linear_fc1": mlp.linear_fc1, "linear_fc2": mlp.linear_fc2}


OURS_WHERE_TP_COMMUNICATES = {"input_layernorm": OverlapRMSNorm, "pre_mlp_layernorm": OverlapRMSNorm,
                              "linear_qkv": OverlapColumnParallelLinear, "linear_fc1": OverlapColumnParallelLinear,
                              "linear_proj": OverlapRowParallelLinear, "linear_fc2": OverlapRowParallelLinear}


def test_te_where_it_does_not_conflict(with_te):
    got = slots(get_gpt_layer_overlap_spec(qk_layernorm=True, transformer_impl="transformer_engine"))
    assert {k: got[k] for k in OURS_WHERE_TP_COMMUNICATES} == OURS_WHERE_TP_COMMUNICATES
    assert got["core_attention"] is TEDotProductAttention
    assert got["q_layernorm"] is TENorm and got["k_layernorm"] is TENorm


def test_local_impl_keeps_te_norms_out(with_te):
    got = slots(get_gpt_layer_overlap_spec(qk_layernorm=True, transformer_impl="local"))
    assert {k: got[k] for k in OURS_WHERE_TP_COMMUNICATES} == OURS_WHERE_TP_COMMUNICATES
    assert got["q_layernorm"] is OverlapQKRMSNorm


def test_without_te_the_same_slots_are_ours(without_te):
    got = slots(get_gpt_layer_overlap_spec(qk_layernorm=True, transformer_impl="transformer_engine"))
    assert {k: got[k] for k in OURS_WHERE_TP_COMMUNICATES} == OURS_WHERE_TP_COMMUNICATES
    assert got["core_attention"] is SDPAttention and got["q_layernorm"] is OverlapQKRMSNorm


@pytest.mark.parametrize("impl, final", [("transformer_engine", TENorm), ("local", OverlapRMSNorm)])
def test_block_final_norm(with_te, monkeypatch, impl, final):
    monkeypatch.setattr(transformer_block, "get_num_layers_to_build", lambda config, vp_stage=None: config.num_layers)
    transformer = SimpleNamespace(num_moe_experts=None, moe_grouped_gemm=False, qk_layernorm=True,
                                  multi_latent_attention=False, qk_l2_norm=False, normalization="RMSNorm",
                                  num_layers=2, transformer_impl=impl)
    block = patches.overlap_layer_spec(SimpleNamespace(transformer=transformer))
    assert block.layer_norm is final and len(block.layer_specs) == 2
    attention = block.layer_specs[0].submodules.self_attention.submodules
    assert attention.linear_qkv is OverlapColumnParallelLinear
    assert attention.q_layernorm is (TENorm if impl == "transformer_engine" else OverlapQKRMSNorm)


@pytest.mark.parametrize("overrides, flag", [({"overlap_tp": "signal"}, "--overlap-tp signal"),
                                             ({"overlap_tp": "auto"}, "--overlap-tp auto"),
                                             ({"overlap_tp": "off", "overlap_tp_layers": True}, "--overlap-tp-layers")])
def test_tp_comm_overlap_with_ours_stays_an_error_with_te(with_te, overrides, flag):
    """Transformer Engine importable and --transformer-impl transformer_engine: --tp-comm-overlap (TE's userbuffers)
    and overlap_tp's layers overlap the same communication, so together they are refused, naming both; the TE
    baseline alone (--tp-comm-overlap, --overlap-tp off) is accepted."""
    from overlap_tp.megatron.arguments import OverlapArgumentError
    from overlap_tp.megatron.validation import validate_overlap_args
    from test_arguments import megatron_like
    with pytest.raises(OverlapArgumentError, match=f"{flag} with --tp-comm-overlap: both overlap the same TP "
                                                   "communication .* Pick one"):
        validate_overlap_args(megatron_like(transformer_impl="transformer_engine", tp_comm_overlap=True, **overrides),
                              warn=None)
    baseline = megatron_like(transformer_impl="transformer_engine", tp_comm_overlap=True, overlap_tp="off")
    assert validate_overlap_args(baseline, warn=None) == []
