"""benchmarks/: the results table's rows are well formed and name what exists; README.md's, docs/performance.md's and
the campaigns' marked tables are what benchmarks/tables.py generates from it; an end-to-end row's kept train.log pair
gives the row's speedup through overlap_tp.training.report."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tables():
    spec = importlib.util.spec_from_file_location("benchmark_tables", os.path.join(ROOT, "benchmarks", "tables.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tables = _tables()
ROWS = tables.load()


def test_rows_are_well_formed_and_name_records_and_logs_that_exist():
    assert ROWS, "benchmarks/results.jsonl is empty"
    assert tables.problems(ROWS) == []


def test_every_campaign_file_has_rows():
    campaigns = {f"benchmarks/{name}" for name in os.listdir(os.path.join(ROOT, "benchmarks"))
                 if tables.CAMPAIGN.fullmatch(f"benchmarks/{name}")}
    assert campaigns == {row["record"] for row in ROWS}


def test_speedups_and_time_ratios_never_share_a_metric():
    for row in ROWS:
        metric = row["metric"]
        assert not (metric.startswith("speedup") and "time ratio" in metric), row
        if row["what"].startswith("e2e ") and "/" in metric and not metric.startswith("ms/"):
            assert metric == tables.E2E_METRIC, row


def test_the_problems_are_named():
    good = dict(ROWS[0])
    wrong = [dict(good, commit="zzz"), dict(good, metric="ratio ours/off"), dict(good, record="benchmarks/x.md"),
             dict(good, logs=["benchmarks/logs/missing.train.log"]), dict(good, value="1.0")]
    found = tables.problems(wrong)
    for needle in ("commit", "ratio", "record", "logs are", "not a number"):
        assert any(needle in line for line in found), (needle, found)


@pytest.mark.parametrize("path", sorted(tables.targets(ROWS)))
def test_marked_tables_are_generated_from_the_results(path):
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    name = tables.targets(ROWS)[path][0]
    begin, end = tables.MARKERS[name]
    assert begin in text and end in text, f"{path} has no {begin} ... {end} markers for its generated table"
    assert text == tables.render(path, ROWS), f"{path}: its table drifted from benchmarks/results.jsonl; " \
                                              f"run python benchmarks/tables.py"


def test_readme_lists_every_end_to_end_speedup_and_marks_rows_without_logs():
    table = tables.results_table(ROWS)
    e2e = [row for row in ROWS if row["metric"] == tables.E2E_METRIC]
    assert e2e and len(table.splitlines()) >= 3
    for line in table.splitlines()[2:]:
        assert "not kept" in line or "benchmarks/logs/" in line, line
    for row in e2e:
        assert tables.number(row["value"], row["metric"]) in table
        assert row["record"] in table


def test_a_missing_marker_is_a_clear_error():
    with pytest.raises(SystemExit, match="results:begin"):
        tables.fill("# no markers here\n", "results", "| a |", "README.md")


@pytest.mark.parametrize("row", [r for r in ROWS if r["logs"]], ids=lambda r: f"{r['what']} {r['date']}")
def test_kept_logs_reproduce_their_rows_speedup(row):
    from overlap_tp.training import report
    runs = [report.load(os.path.join(ROOT, path)) for path in row["logs"]]   # off, on
    assert all(run.points for run in runs)
    speedup = report.summary_rows(runs)[1]["speedup"]   # overlap-tp-report's default warm-up skip
    assert speedup == pytest.approx(row["value"], abs=0.0005 + 1e-9), (speedup, row)


def test_some_end_to_end_row_keeps_its_logs():
    assert any(row["logs"] for row in ROWS)
