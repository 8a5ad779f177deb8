"""launch/check.py: the launchers' `--check` (Megatron's argument parser and validation plus overlap_tp's, on the
CPU, `ok` or one line, 0 or 2) and their one-line argument errors (rank 0 only, no traceback, status 2)."""
import sys
from types import SimpleNamespace

import pytest

from overlap_tp.launch import check as checking
from overlap_tp.launch import pretrain

# a two-layer GPT at TP 2 with sequence parallelism: what Megatron's validation and overlap_tp's accept
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
         "--max-position-embeddings", "128", "--micro-batch-size", "1", "--vocab-size", "1000", "--bf16",
         "--tensor-model-parallel-size", "2", "--sequence-parallel", "--normalization", "RMSNorm",
         "--train-iters", "2", "--no-gradient-accumulation-fusion", "--transformer-impl", "local",
         "--overlap-tp", "signal"]


def megatron_training():
    return pytest.importorskip("megatron.training.arguments",
                               reason="megatron.training: megatron-core >= 0.19 on Python >= 3.12", exc_type=ImportError)


@pytest.fixture
def no_gpu_no_group(monkeypatch):
    """CUDA and torch.distributed that fail when touched; the run's environment for sequence parallelism."""
    import torch
    megatron_training()   # imported before CUDA is made to fail (its import may ask whether CUDA is there)

    def touched(*args, **kwargs):
        raise AssertionError("the check touched CUDA or torch.distributed")

    for name in ("_lazy_init", "init", "get_device_properties", "get_device_capability", "current_device",
                 "set_device", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, touched)
    monkeypatch.setattr(torch.distributed, "init_process_group", touched)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    return torch


def test_ok_on_the_cpu_without_cuda_or_a_process_group(no_gpu_no_group, capsys):
    assert checking.check("overlap-tp-pretrain", SMALL, defaults=pretrain.DEFAULTS) == 0
    out, err = capsys.readouterr()
    assert out == "ok (world size 2)\n" and err == ""   # Megatron's warnings and argument table swallowed
    torch = no_gpu_no_group
    assert not torch.distributed.is_initialized()
    with pytest.raises(AssertionError, match="touched CUDA"):   # the check's stand-in answer is taken back
        torch.cuda.get_device_capability()


@pytest.mark.parametrize("extra, env, message", [
    ([], {"WORLD_SIZE": "3"}, "world size (3) is not divisible by total_model_size (total_model_size=2)"),
    (["--num-attention-heads", "1"], {}, "num_attention_heads (1) must be a multiple of tensor_model_parallel_size"),
    (["--num-attention-heads", "3"], {}, "assert args.hidden_size % args.num_attention_heads == 0 failed (arguments"),
    (["--num-experts", "4", "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1",
      "--overlap-tp", "off"], {"WORLD_SIZE": "2"}, "world size (2) is not divisible by expert-tensor x expert x"),
    (["--no-sequence-parallel-please"], {}, "unrecognized arguments: --no-sequence-parallel-please"),
    (["--normalization", "LayerNorm"], {}, "--overlap-tp signal with --normalization LayerNorm"),
    (["--tp-comm-overlap"], {}, "--overlap-tp signal with --tp-comm-overlap"),
    ([], {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, "Using tensor model parallelism or context parallelism require"),
])
def test_each_problem_is_one_line_and_status_2(no_gpu_no_group, monkeypatch, capsys, extra, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert checking.check("overlap-tp-pretrain", SMALL + extra, defaults=pretrain.DEFAULTS) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"overlap-tp-pretrain: {message}"), err


def test_overlap_tp_notes_are_printed_before_ok(no_gpu_no_group, capsys):
    argv = SMALL + ["--transformer-impl", "transformer_engine"]
    assert checking.check("overlap-tp-run", argv) == 0
    out, err = capsys.readouterr()
    assert out == "ok (world size 2)\n"
    assert err.startswith("overlap-tp-run: note: --overlap-tp signal with --transformer-impl transformer_engine")
    assert checking.check("overlap-tp-run", argv, quiet=True) == 0   # the preflight: the run gives the notes
    assert capsys.readouterr() == ("", "")


def test_without_megatron_the_check_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "megatron.training.arguments", None)   # import fails
    assert checking.check("overlap-tp-pretrain", SMALL) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "megatron-core >= 0.19" in err and "Megatron-LM checkout on PYTHONPATH" in err


def test_pretrain_check_needs_no_gpu(no_gpu_no_group, monkeypatch, capsys):
    monkeypatch.setattr(pretrain, "require_gpus", lambda local_ranks: pytest.fail("--check counted GPUs"))
    assert pretrain.main(["--check"] + SMALL) == 0
    assert capsys.readouterr().out == "ok (world size 2)\n"


def test_smallest_world_fits_the_dense_and_the_expert_layout():
    def args(**sizes):
        return SimpleNamespace(**{f"{name}_parallel_size": size for name, size in sizes.items()})

    assert checking.smallest_world(args(tensor_model=2)) == 2
    assert checking.smallest_world(args(tensor_model=2, expert_model=4, expert_tensor=1)) == 4
    assert checking.smallest_world(args(tensor_model=2, expert_model=3, expert_tensor=None)) == 6   # ETP = TP
    assert checking.smallest_world(args(tensor_model=4, pipeline_model=2, context=2, expert_model=2,
                                        expert_tensor=1)) == 16


@pytest.mark.parametrize("rank, printed", [("0", "overlap-tp-run: what to change\n"), ("1", "")])
def test_refuse_prints_on_rank_0_only(monkeypatch, capsys, rank, printed):
    monkeypatch.setenv("RANK", rank)
    assert checking.refuse("overlap-tp-run", "what to change") == 2
    assert capsys.readouterr() == ("", printed)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_pretrain_prints_an_overlap_argument_error_once_on_rank_0(monkeypatch, capsys, rank):
    """An OverlapArgumentError after Megatron's validation: one line on rank 0, nothing elsewhere, status 2."""
    arguments = megatron_training()
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(pretrain, "require_gpus", lambda local_ranks: None)
    monkeypatch.setattr(pretrain, "use_prebuilt_dataset_helpers", lambda: None)
    monkeypatch.setattr(pretrain, "separate_adam_steps", lambda: None)
    parsed = SimpleNamespace(overlap_tp="signal", tensor_model_parallel_size=2, sequence_parallel=False)
    monkeypatch.setattr(arguments, "parse_and_validate_args", lambda **kwargs: parsed)
    assert pretrain.main(SMALL) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    if rank == "0":
        assert err.count("\n") == 1 and err.startswith("overlap-tp-pretrain: --overlap-tp signal needs --sequence-")
    else:
        assert err == ""
