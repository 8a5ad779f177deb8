"""Each dense op's class is the factory of its strategies: strategy_for picks one plan class per (method, transport,
pulls) from the resolved config, device and shape, and refuses a config that no strategy runs with the message users
got before the split; a plan names its strategy in describe() as before. The choice is read without a GPU or a
process group (strategy_for and describe read the plan's resolved state only); under gloo, the op's class returns the
strategy's plan, and a strategy's class refuses a config that another strategy runs."""
import pytest
import torch

from overlap_tp.ops import ag_gemm as ag
from overlap_tp.ops import gemm_ar as ar
from overlap_tp.ops import gemm_rs as rs
from overlap_tp.kernels.fp8_gemm import Fp8SignaledGemm
from overlap_tp.kernels.signaled_gemm import SignaledGemm
from overlap_tp.ops.config import OverlapConfig
from overlap_tp.ops.fp8 import FP8_TILES, Fp8Operands, Fp8Plan, fp8_config
from overlap_tp.ops.resolve import common_defaults
from distributed import run_distributed
from problems import SMALL_TILES

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def _resolved(cls, config, device=CUDA, m=64, n=64, k=32, t=2):
    """A plan of `cls` in the state strategy_for and describe read: the resolved config, device, shape and group
    size."""
    plan = object.__new__(cls)
    plan.config, plan.method, plan.device = config, config.method, device
    plan.m, plan.n, plan.k, plan.t = m, n, k, t
    return plan


def _config(**fields):
    """A config as a plan holds it resolved: the fields given, transport / comm_sms / groups / copy_lanes / chunk_by /
    rs_transfer fixed (nccl, 16, auto, 1, rows, epilogue: what each case below assumes unless it names the field) and
    the rest resolve.common_defaults."""
    return common_defaults(OverlapConfig(**{"transport": "nccl", "comm_sms": 16, "groups": "auto", "copy_lanes": 1,
                                            "chunk_by": "rows", "rs_transfer": "epilogue", **fields}))


AG_CASES = [   # (config, device, the strategy or a ValueError's message)
    (_config(method="off"), CUDA, ag.AgGemmOff),
    (_config(method="off", transport="p2p"), CPU, ag.AgGemmOff),
    (_config(method="decompose"), CUDA, ag.AgGemmDecomposedNccl),
    (_config(method="decompose"), CPU, ag.AgGemmDecomposedNccl),
    (_config(method="decompose", transport="p2p"), CUDA, ag.AgGemmDecomposedP2P),
    (_config(method="decompose", transport="p2p", chunk_by="peer"), CUDA, ag.AgGemmDecomposedP2P),
    (_config(method="decompose", transport="p2p"), CPU, "ag_gemm: transport='p2p' needs CUDA tensors"),
    (_config(method="signal", comm_sms=16), CUDA, ag.AgGemmSignaledNccl),
    (_config(method="signal", comm_sms=0), CPU, ag.AgGemmSignaledNccl),
    (_config(method="signal", comm_sms=0), CUDA, "with transport='nccl' needs comm_sms >= 1"),
    (_config(method="signal", transport="p2p", comm_sms=0), CUDA, ag.AgGemmSignaledCopyEngines),
    (_config(method="signal", transport="p2p", comm_sms=0, chunk_by="peer"), CUDA, ag.AgGemmSignaledCopyEngines),
    (_config(method="signal", transport="p2p", comm_sms=0, copy_lanes=2), CUDA, ag.AgGemmSignaledCopyLanes),
    (_config(method="signal", transport="p2p", comm_sms=16), CUDA, ag.AgGemmSignaledSMPulls),
    (_config(method="signal", transport="p2p", comm_sms=16, copy_lanes=2), CUDA, "copy_lanes=2 splits the copy"),
    (_config(method="signal", transport="p2p", comm_sms=0), CPU, "ag_gemm: transport='p2p' needs CUDA tensors"),
    (_config(method="signal", comm_sms=16, chunk_by="peer"), CUDA, "chunk_by='peer' pulls one peer's rows"),
    (_config(method="signal", transport="p2p", comm_sms=16, chunk_by="peer"), CUDA, "chunk_by='peer' pulls"),
    (_config(method="signal", transport="p2p", comm_sms=0, copy_lanes=2, chunk_by="peer"), CUDA,
     "chunk_by='peer' pulls"),
    (_config(method="decompose", chunk_by="peer"), CUDA, "chunk_by='peer' pulls"),
]


@pytest.mark.parametrize("config, device, expected", AG_CASES)
def test_ag_gemm_picks_one_strategy_or_says_why_none_runs(config, device, expected):
    plan = _resolved(ag.AgGemm, config, device)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            plan.strategy_for()
    else:
        assert plan.strategy_for() is expected
        assert issubclass(expected, ag.AgGemm)


def test_ag_gemm_gathers_in_a_buffer_of_its_own_on_the_p2p_strategies_only():
    own = object()   # strategy_for reads only whether a buffer was given
    p2p = _config(method="signal", transport="p2p", comm_sms=0)
    assert _resolved(ag.AgGemm, p2p).strategy_for(gather=own) is ag.AgGemmSignaledCopyEngines
    decompose = _config(method="decompose", transport="p2p")
    assert _resolved(ag.AgGemm, decompose).strategy_for(gather=own) is ag.AgGemmDecomposedP2P
    for config, device in ((_config(method="signal", comm_sms=16), CUDA), (_config(method="off"), CUDA), (p2p, CPU)):
        with pytest.raises(ValueError, match="a gather buffer of its own is for the p2p transport"):
            _resolved(ag.AgGemm, config, device).strategy_for(gather=own)


REDUCTION_CASES = [   # (op's class, config, device, m, the strategy or a ValueError's message)
    (rs.GemmRS, _config(method="off"), CPU, 64, rs.GemmRSOff),
    (rs.GemmRS, _config(method="decompose"), CUDA, 64, rs.GemmRSDecomposedNccl),
    (rs.GemmRS, _config(method="signal"), CPU, 64, rs.GemmRSSignaledNccl),
    (rs.GemmRS, _config(method="signal", transport="p2p"), CUDA, 64, rs.GemmRSOverP2P),
    (rs.GemmRS, _config(method="decompose", transport="p2p", rs_transfer="copy"), CUDA, 64, rs.GemmRSOverP2P),
    (rs.GemmRS, _config(method="signal", transport="p2p"), CPU, 64, "gemm_rs: transport='p2p' needs CUDA tensors"),
    (rs.GemmRS, _config(method="signal", schedule="tile_exact", block_m=64), CUDA, 64,
     r"schedule 'tile_exact' needs M/t=32 % block_m=64 == 0"),
    (ar.GemmAR, _config(method="off"), CPU, 64, ar.GemmAROff),
    (ar.GemmAR, _config(method="decompose"), CPU, 64, ar.GemmARDecomposedNccl),
    (ar.GemmAR, _config(method="signal"), CUDA, 64, ar.GemmARSignaledNccl),
    (ar.GemmAR, _config(method="decompose", transport="p2p"), CUDA, 64, ar.GemmAROverP2P),
    (ar.GemmAR, _config(method="signal", transport="p2p"), CUDA, 63, "reduces rows in t regions: M=63"),
    (ar.GemmAR, _config(method="signal", transport="p2p"), CPU, 64, "gemm_ar: transport='p2p' needs CUDA tensors"),
    (ar.GemmAR, _config(method="signal", schedule="tile_exact", block_m=128), CUDA, 64,
     r"schedule 'tile_exact' needs M=64 % block_m=128 == 0"),
]


@pytest.mark.parametrize("op, config, device, m, expected", REDUCTION_CASES)
def test_reductions_pick_one_strategy_or_say_why_none_runs(op, config, device, m, expected):
    plan = _resolved(op, config, device, m=m)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            plan.strategy_for()
    else:
        assert plan.strategy_for() is expected and issubclass(expected, op)


@pytest.mark.parametrize("strategy, config, label", [
    (ag.AgGemmOff, _config(method="off"), "off"),
    (ag.AgGemmDecomposedNccl, _config(method="decompose"), "decompose"),
    (ag.AgGemmDecomposedP2P, _config(method="decompose", transport="p2p"), "decompose/p2p"),
    (ag.AgGemmSignaledNccl, _config(method="signal"), "signal/nccl"),
    (ag.AgGemmSignaledCopyEngines, _config(method="signal", transport="p2p", comm_sms=0), "signal/p2p"),
    (ag.AgGemmSignaledCopyLanes, _config(method="signal", transport="p2p", comm_sms=0, copy_lanes=2), "signal/p2p"),
    (ag.AgGemmSignaledSMPulls, _config(method="signal", transport="p2p"), "signal/p2p"),
    (rs.GemmRSOff, _config(method="off"), "off"),
    (rs.GemmRSDecomposedNccl, _config(method="decompose"), "decompose"),
    (rs.GemmRSSignaledNccl, _config(method="signal"), "signal/nccl"),
    (rs.GemmRSOverP2P, _config(method="signal", transport="p2p"), "signal/p2p"),
    (rs.GemmRSOverP2P, _config(method="signal", transport="p2p", rs_transfer="copy"), "signal/p2p/copy"),
    (rs.GemmRSOverP2P, _config(method="decompose", transport="p2p", rs_transfer="copy"), "decompose/p2p/copy"),
    (ar.GemmAROverP2P, _config(method="decompose", transport="p2p"), "decompose/p2p"),
    (ar.GemmARSignaledNccl, _config(method="signal"), "signal/nccl"),
])
def test_a_plan_names_its_strategy_as_before(strategy, config, label):
    assert _resolved(strategy, config).describe() == f"{strategy.op}(M=64, N=64, K=32, t=2, {label})"


def _check_factories(rank, world):
    signal = OverlapConfig(method="signal", groups=2, **SMALL_TILES)
    for config, strategies in ((OverlapConfig(method="off"), (rs.GemmRSOff, ar.GemmAROff, ag.AgGemmOff)),
                               (OverlapConfig(method="decompose", chunks=2),
                                (rs.GemmRSDecomposedNccl, ar.GemmARDecomposedNccl, ag.AgGemmDecomposedNccl)),
                               (signal, (rs.GemmRSSignaledNccl, ar.GemmARSignaledNccl, ag.AgGemmSignaledNccl))):
        plans = (rs.GemmRS(None, 64, 48, 16, torch.bfloat16, "cpu", config),
                 ar.GemmAR(None, 64, 48, 16, torch.bfloat16, "cpu", config),
                 ag.AgGemm(None, 64 // world, 48, 32, torch.bfloat16, "cpu", config))
        assert tuple(type(plan) for plan in plans) == strategies
        assert all(plan.config.method == config.method for plan in plans)
    # a strategy's own class builds that strategy, and refuses a config that another one runs (before any state)
    assert type(rs.GemmRSSignaledNccl(None, 64, 48, 16, torch.bfloat16, "cpu", signal)) is rs.GemmRSSignaledNccl
    with pytest.raises(ValueError, match="GemmRSOff does not run this config"):
        rs.GemmRSOff(None, 64, 48, 16, torch.bfloat16, "cpu", signal)


def test_the_op_classes_return_their_strategies_plans():
    run_distributed(2, _check_factories)


# ---------------------------------------------------------------------------------------------------
# FP8 operands: each strategy's FP8 counterpart, or a ValueError naming what to use
# ---------------------------------------------------------------------------------------------------

TENSORWISE = Fp8Operands(torch.float8_e4m3fn, "tensorwise", torch.float8_e4m3fn, "tensorwise")
BLOCKWISE = Fp8Operands(torch.float8_e4m3fn, "1x128", torch.float8_e4m3fn, "128x128")

FP8_CASES = [   # (op's class, config, device, the strategy or a ValueError's message)
    (ag.AgGemm, _config(method="off"), CPU, ag.AgGemmOffFp8),
    (ag.AgGemm, _config(method="signal"), CPU, ag.AgGemmSignaledNcclFp8),
    (ag.AgGemm, _config(method="signal", comm_sms=16), CUDA, ag.AgGemmSignaledNcclFp8),
    (ag.AgGemm, _config(method="signal", transport="p2p", comm_sms=0), CUDA, ag.AgGemmSignaledP2PFp8),
    (ag.AgGemm, _config(method="signal", transport="p2p", comm_sms=0, chunk_by="peer"), CUDA, ag.AgGemmSignaledP2PFp8),
    (ag.AgGemm, _config(method="signal", transport="p2p", comm_sms=0, copy_lanes=2), CUDA, "use copy_lanes=1"),
    (ag.AgGemm, _config(method="signal", transport="p2p", comm_sms=16), CUDA, "use comm_sms=0"),
    (ag.AgGemm, _config(method="decompose"), CUDA, "method='decompose' .* has no FP8 strategy; use method='signal'"),
    (ag.AgGemm, _config(method="decompose", transport="p2p"), CUDA, "has no FP8 strategy"),
    (ag.AgGemm, _config(method="signal", comm_sms=0), CUDA, "needs comm_sms >= 1"),   # the bf16 rule holds
    (rs.GemmRS, _config(method="off"), CPU, rs.GemmRSOffFp8),
    (rs.GemmRS, _config(method="signal"), CPU, rs.GemmRSSignaledNcclFp8),
    (rs.GemmRS, _config(method="signal", transport="p2p"), CUDA, rs.GemmRSOverP2PFp8),
    (rs.GemmRS, _config(method="signal", transport="p2p", rs_transfer="copy"), CUDA, rs.GemmRSOverP2PFp8),
    (rs.GemmRS, _config(method="decompose", transport="p2p"), CUDA, "has no FP8 strategy"),
    (rs.GemmRS, _config(method="decompose"), CPU, "has no FP8 strategy"),
    (rs.GemmRS, _config(method="signal", transport="p2p"), CPU, "gemm_rs: transport='p2p' needs CUDA tensors"),
    (ar.GemmAR, _config(method="off"), CUDA, ar.GemmAROffFp8),
    (ar.GemmAR, _config(method="signal"), CUDA, ar.GemmARSignaledNcclFp8),
    (ar.GemmAR, _config(method="signal", transport="p2p"), CUDA, ar.GemmAROverP2PFp8),
    (ar.GemmAR, _config(method="decompose"), CUDA, "has no FP8 strategy"),
]


@pytest.mark.parametrize("fp8", [TENSORWISE, BLOCKWISE], ids=["tensorwise", "blockwise"])
@pytest.mark.parametrize("op, config, device, expected", FP8_CASES)
def test_fp8_operands_pick_the_fp8_counterpart_or_say_what_to_use(op, config, device, expected, fp8):
    plan = _resolved(op, config, device)
    plan.fp8 = fp8
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            plan.strategy_for()
    else:
        strategy = plan.strategy_for()
        assert strategy is expected and issubclass(expected, op) and issubclass(expected, Fp8Plan)
        plan.__class__ = strategy   # a plan names its recipe after its strategy's label
        assert plan.describe().endswith(f", {fp8})") and str(fp8).startswith("fp8 e4m3 ")


def test_every_fp8_strategy_follows_a_bf16_strategy_and_launches_the_fp8_gemm():
    for table in (ag.FP8_STRATEGIES, rs.FP8_STRATEGIES, ar.FP8_STRATEGIES):
        for bf16, fp8 in table.items():
            if isinstance(fp8, str):
                continue
            assert fp8.__mro__[1:3] == (Fp8Plan, bf16) and fp8.variant == bf16.variant
            assert fp8.launcher is Fp8SignaledGemm and bf16.launcher is SignaledGemm


def test_an_fp8_gather_buffer_of_its_own_is_refused():
    plan = _resolved(ag.AgGemm, _config(method="signal", transport="p2p", comm_sms=0))
    plan.fp8 = TENSORWISE
    with pytest.raises(ValueError, match="pass no gather buffer"):
        plan.strategy_for(gather=object())


def test_an_fp8_config_gets_the_fp8_tile_of_its_scaling_and_names_its_method_on_cuda():
    for operands, tile in ((TENSORWISE, (128, 256, 128, 3, 8)), (BLOCKWISE, (64, 128, 128, 3, 4))):
        filled = fp8_config(OverlapConfig(method="signal"), "gemm_rs", CPU, operands)
        assert (filled.block_m, filled.block_n, filled.block_k, filled.num_stages, filled.num_warps) == tile
        assert {name: getattr(filled, name) for name in FP8_TILES[operands.a_scaling]} == \
            FP8_TILES[operands.a_scaling]
    kept = fp8_config(OverlapConfig(method="signal", block_n=256), "gemm_rs", CUDA, BLOCKWISE)
    assert (kept.block_m, kept.block_n, kept.block_k) == (64, 256, 128)   # a field set is kept
    for config in (OverlapConfig(), OverlapConfig(method="auto")):
        with pytest.raises(ValueError, match="method 'auto' is not tuned for FP8"):
            fp8_config(config, "ag_gemm", CUDA, TENSORWISE)
    # the resolver runs it as 'off' on CPU
    assert fp8_config(OverlapConfig(), "ag_gemm", CPU, TENSORWISE).method is None
    plan = _resolved(rs.GemmRS, _config(method="signal", block_k=64), k=256)
    plan.fp8 = BLOCKWISE
    assert "needs block_k=128" in plan._signal_unsupported_reason(plan.config)
    plan.fp8, plan.k = TENSORWISE, 40
    assert "K=40 is not a multiple of 16" in plan._signal_unsupported_reason(plan.config)
