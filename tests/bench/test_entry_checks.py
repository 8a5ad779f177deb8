"""The benchmark and tuner entry points stop with one line where the launch or the machine cannot run them,
instead of a traceback from deep inside torch (torch.cuda.set_device on a CPU-only build); `--help` lists the
benchmarks."""
import os
import subprocess
import sys

import pytest

from overlap_tp.bench import __main__ as bench


def test_distributed_benchmarks_need_torchrun_a_group_and_gpus():
    assert "under torchrun" in bench.requirement_problem("ops", [], environ={}, cuda_devices=8)
    one = {"RANK": "0", "WORLD_SIZE": "1"}
    assert "2 or more ranks (WORLD_SIZE is 1)" in bench.requirement_problem("ops", [], environ=one, cuda_devices=8)
    two = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert "2 ranks on this node but 0 visible CUDA GPU(s)" in bench.requirement_problem(
        "moe", [], environ=two, cuda_devices=0)
    assert bench.requirement_problem("ops", [], environ=two, cuda_devices=2) is None
    one_gpu = dict(one, LOCAL_WORLD_SIZE="1")
    assert bench.requirement_problem("moe_layer", [], environ=one_gpu, cuda_devices=1) is None   # EP = 1: own cost
    assert bench.requirement_problem("moe", [], environ=one_gpu, cuda_devices=1) is None
    assert bench.requirement_problem("layer", [], environ=one_gpu, cuda_devices=1) is None   # TP 1: own computation
    assert bench.requirement_problem("layer", ["--device", "cpu"], environ={}, cuda_devices=0) is None
    assert bench.requirement_problem("norm", [], environ={}, cuda_devices=0) is None   # checks its GPU itself


def test_help_lists_every_subcommand_with_one_line_and_exits_0():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-m", "overlap_tp.bench", "--help"], capture_output=True, text=True,
                            cwd=root)
    assert result.returncode == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0].startswith("usage: python -m overlap_tp.bench SUBCOMMAND")
    listed = {line.split()[0]: line.split(None, 1)[1] for line in lines if line.startswith("  ")}
    assert listed == bench.DESCRIPTIONS and list(listed) == list(bench.SUBCOMMANDS)
    assert all(description for description in listed.values())


def test_no_or_an_unknown_subcommand_prints_the_list_and_returns_2(capsys):
    assert bench.main([]) == 2
    assert "subcommands:" in capsys.readouterr().err
    assert bench.main(["layers"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m overlap_tp.bench: unknown subcommand 'layers'\n") and "  moe_layer  " in err


def test_main_prints_the_line_and_returns_2(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert bench.main(["ops", "--sweep"]) == 2
    assert "torchrun --nproc-per-node 2 -m overlap_tp.bench ops" in capsys.readouterr().err


@pytest.mark.parametrize("environ, message", [
    ({"RANK": "0", "WORLD_SIZE": "1"}, "2 or more ranks"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "needs CUDA GPUs"),
])
def test_tune_checks_before_touching_cuda(monkeypatch, capsys, environ, message):
    import torch

    from overlap_tp.tune import __main__ as tune
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert tune.main([]) == 2
    assert message in capsys.readouterr().out


def test_moe_layer_bench_variants_name_their_expert_config():
    from overlap_tp.bench.moe_layer import variant_config
    p2p = variant_config("signal-p2p")
    assert (p2p.method, p2p.transport, p2p.comm_sms) == ("signal", "p2p", 0)
    cublas = variant_config("decompose-p2p")
    assert (cublas.method, cublas.transport, cublas.comm_sms) == ("decompose", "p2p", 0)
    nccl = variant_config("signal")
    assert (nccl.method, nccl.transport) == ("signal", "nccl") and nccl.comm_sms > 0
    assert variant_config("off").method == "off"
    swept = variant_config("signal.g4.sm8")
    assert (swept.method, swept.transport, swept.groups, swept.comm_sms) == ("signal", "nccl", 4, 8)
    assert variant_config("signal-p2p.g3").groups == 3 and variant_config("signal-p2p.g3").transport == "p2p"
    with pytest.raises(ValueError, match="'x2' is not gN"):
        variant_config("signal.x2")


def test_moe_layer_bench_counts_triton_compiles_by_kernel_and_restores_the_hook():
    knobs = pytest.importorskip("triton").knobs
    from overlap_tp.bench.moe_layer import triton_compiles
    seen, original = [], knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = earlier = lambda *a, **k: seen.append(k["fn"].name)
    try:
        fn = type("JitFunctionInfo", (), {"name": "signaled_gemm_kernel"})()
        other = type("JitFunctionInfo", (), {"name": "signaled_pull_kernel"})()
        with triton_compiles() as compiled:
            for f in (fn, other, fn):   # as Triton calls the hook: keyword arguments, fn among them
                knobs.runtime.jit_post_compile_hook(key=0, repr="", fn=f, compile={}, is_manual_warmup=False,
                                                    already_compiled=False)
        assert compiled == {"signaled_gemm_kernel": 2, "signaled_pull_kernel": 1}
        assert seen == ["signaled_gemm_kernel", "signaled_pull_kernel", "signaled_gemm_kernel"]   # chained
        assert knobs.runtime.jit_post_compile_hook is earlier   # put back
    finally:
        knobs.runtime.jit_post_compile_hook = original
