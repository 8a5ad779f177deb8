"""overlap_tp.training.report renders the recorded sample logs (tests/data: baseline vs overlap, Megatron 0.19's
training_log format plus overlap_tp's lines); the W&B dashboard in its dry-run and offline modes."""
import json
import os

import pytest

from overlap_tp.training import report, wandb_dashboard

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
OFF = os.path.join(DATA, "smoke-off.log")
SIGNAL = os.path.join(DATA, "smoke-signal.log")


def test_parse_megatron_and_overlap_lines():
    run = report.load(SIGNAL)
    assert run.label == "smoke-signal"
    assert run.args["seq_length"] == "2048" and run.args["overlap_tp"] == "signal"
    assert sorted(run.points) == list(range(5, 65, 5))
    point = run.points[10]
    assert point["step_time_ms"] == 93.5 and point["tflops_per_gpu"] == 45.3
    assert point["tokens_per_sec_per_gpu"] == 87615.0
    assert point["mfu"] == 4.58 and point["comm_hidden"] == 0.62 and point["exposed_comm_ms"] == 1.33
    assert point["loss"] == pytest.approx(8.897222)
    assert not report.load(OFF).has("comm_hidden")


def test_derived_values_without_overlap_tp_lines():
    with open(OFF) as f:
        lines = [line for line in f if "[overlap_tp]" not in line]
    run = report.parse_log(lines, "megatron only", peak=1000.0)
    point = run.points[10]
    # tokens/s/GPU = global batch 8 * 2048 / (0.104 s * 2 GPUs); MFU = 40.8 / 1000 in percent
    assert point["tokens_per_sec_per_gpu"] == pytest.approx(8 * 2048 / (0.104 * 2))
    assert point["mfu"] == pytest.approx(4.08)


def test_summary_speedup_against_the_first_run():
    rows = report.summary_rows([report.load(OFF), report.load(SIGNAL)])
    assert rows[0]["speedup"] == 1.0
    assert rows[1]["speedup"] == pytest.approx(rows[0]["step_time_ms"] / rows[1]["step_time_ms"])
    assert rows[1]["speedup"] > 1.05
    assert rows[0]["step_time_ms"] < 200  # the warm-up interval is left out of the medians


def test_renders_png_and_html(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="pip install matplotlib (the dev/report extras)")
    assert report.main([OFF, f"{SIGNAL}=overlap (signal)", "--out", str(tmp_path)]) == 0
    png = tmp_path / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    page = (tmp_path / "report.html").read_text()
    for text in ("smoke-off", "overlap (signal)", "data:image/png;base64,", "Communication hidden", "speedup"):
        assert text in page
    assert "speedup=1.1" in capsys.readouterr().out


def test_a_log_without_training_lines_is_an_error(tmp_path):
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    assert report.main([str(empty), "--out", str(tmp_path / "out")]) == 1


def test_wandb_dashboard_dry_run(capsys):
    assert wandb_dashboard.main(["--project", "overlap_tp", "--entity", "team", "--dry-run"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["kind"] == "report" and spec["project"] == "overlap_tp" and spec["entity"] == "team"
    titles = [p["title"] for p in spec["panels"]]
    assert titles[:4] == ["Throughput", "Tokens", "MFU", "Step time"] and "Loss" in titles
    assert ["overlap_tp/tflops_per_gpu"] in [p["y"] for p in spec["panels"]]
    assert wandb_dashboard.plan("p", workspace=True)["kind"] == "workspace"


def test_wandb_dashboard_offline_says_what_to_do(monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_dashboard.main(["--project", "overlap_tp"]) == 2
    assert "wandb sync" in capsys.readouterr().err
