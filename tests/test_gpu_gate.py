"""The GPU gate, checked on the CPU: the one-GPU summary of the whole GPU suite (tests/gpu/results/1gpu.json, written
by tests/gpu/gpu_suite.py) passed, covers every GPU test file, and was taken of the gated sources exactly as they are
here (their hash). A change to kernels/, overlap_tp/ops/, overlap_tp/megatron/, overlap_tp/tune/ or tests/gpu/ lands
with a new summary, after the suite ran on the device at that change."""
import glob
import json
import os

import pytest

import gpu_suite


def _summaries():
    return sorted(glob.glob(os.path.join(gpu_suite.RESULTS, "*gpu.json")))


def test_the_one_gpu_suite_passed_on_these_sources():
    path = gpu_suite.summary_path(1, "json")
    assert os.path.exists(path), "no one-GPU summary: run `python tests/gpu/gpu_suite.py run` on a GPU (README, Tests)"
    with open(path) as f:
        summary = json.load(f)
    assert summary["machine"]["gpus"] == 1
    assert summary["source_hash"] == gpu_suite.source_hash(), (
        f"the gated sources changed since the one-GPU suite ran at {summary['commit']}: run it again on the device "
        f"and commit its summary (tests/gpu/gpu_suite.py)")
    assert set(summary["files"]) == set(gpu_suite.test_files())
    assert gpu_suite.problems(summary) == []


@pytest.mark.parametrize("path", _summaries(), ids=os.path.basename)
def test_each_kept_summary_is_rendered_from_its_record(path):
    with open(path) as f:
        summary = json.load(f)
    with open(path[:-len("json")] + "md") as f:
        assert f.read() == gpu_suite.render(summary)


def test_a_summary_with_a_failure_a_test_not_reached_or_a_foreign_skip_does_not_pass():
    meta = {"commit": "c", "source_hash": "h", "date": "d", "command": "x",
            "machine": {"gpus": 1, "cards": ["H"], "driver": "1", "python": "3", "torch": "t", "cuda": "c",
                        "triton": "t", "nccl": "n", "megatron-core": "m"}}
    files = gpu_suite.test_files()
    collected = [f"{files[0]}::test_a", f"{files[0]}::test_b", f"{files[0]}::test_c", f"{files[0]}::test_d"]
    records = [{"collected": collected},
               {"test": collected[0], "when": "call", "outcome": "passed", "seconds": 1.0},
               {"test": collected[1], "when": "setup", "outcome": "skipped", "seconds": 0.0,
                "reason": "needs 2 GPUs, 1 here"},
               {"test": collected[2], "when": "call", "outcome": "failed", "seconds": 2.0, "text": "boom"},
               {"chunk": 1, "files": files, "exit": 1, "seconds": 5.0}]
    summary = gpu_suite.merge([records], meta)
    row = summary["files"][files[0]]
    assert (row["passed"], row["failed"], row["skipped"], row["not_run"]) == (1, 1, 1, 1)
    assert gpu_suite.problems(summary) == [f"{files[0]}: 1 failed", f"{files[0]}: 1 not run"]
    records[2]["reason"] = "megatron-core is not installed"
    assert f"{files[0]}: 1 skipped (megatron-core is not installed)" in gpu_suite.problems(gpu_suite.merge([records],
                                                                                                           meta))
    assert gpu_suite.problems(gpu_suite.merge([[{"collected": []}]], meta))[0] == f"{files[0]}: not run"
    assert "NOT PASSED" in gpu_suite.render(summary)
