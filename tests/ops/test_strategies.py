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
from overlap_tp.ops.config import OverlapConfig
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
