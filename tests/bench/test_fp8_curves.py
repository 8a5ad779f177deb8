"""benchmarks/device/fp8_curves.py's own check on the CPU (--cpu: gloo, the Triton interpreter, the ops on their
NCCL transport over gloo): two short runs write one row each (losses, final loss, its ratio to bf16's) and the SVG."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core", reason="the layers need megatron-core")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_two_short_runs_write_their_rows_and_the_plot(tmp_path):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "device", "fp8_curves.py"), "--cpu",
                          "--steps", "2", "--layers", "1", "--runs", "bf16,e4m3/tensorwise", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "fp8_curves.jsonl").read_text().splitlines()]
    assert [r["run"] for r in rows] == ["bf16", "e4m3/tensorwise"]
    assert all(len(r["losses"]) == 2 and 0 < r["final"] < 20 for r in rows)
    assert rows[0]["final_vs_bf16"] == 1.0 and abs(rows[1]["final_vs_bf16"] - 1) < 0.05
    assert rows[1]["losses"] != rows[0]["losses"]   # the FP8 run really ran FP8
    assert (tmp_path / "fp8_curves.svg").read_text().count("<polyline") == 2


def test_render_writes_the_rows_and_the_plot_from_a_partial_file(tmp_path):
    partial = tmp_path / "fp8_curves.partial.jsonl"
    runs = {"bf16": [4.0] * 10 + [2.0] * 20, "e4m3/blockwise": [4.0] * 10 + [2.02] * 20}
    partial.write_text("".join(json.dumps({"run": run, "losses": losses, "seconds": 1.0}) + "\n"
                               for run, losses in reversed(list(runs.items()))))
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "device", "fp8_curves.py"),
                          "--render", str(partial), "--out", str(tmp_path), "--commit", "abc1234", "--cards", "H100"],
                         capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "fp8_curves.jsonl").read_text().splitlines()]
    assert [r["run"] for r in rows] == ["bf16", "e4m3/blockwise"]   # the --runs order, bf16 first
    assert rows[0]["final"] == 2.0 and abs(rows[1]["final_vs_bf16"] - 1.01) < 1e-9
    assert rows[1]["commit"] == "abc1234" and rows[1]["cards"] == "H100" and rows[1]["steps"] == 30
    assert (tmp_path / "fp8_curves.svg").read_text().count("<polyline") == 2
