"""`python -m overlap_tp.training.wandb_dashboard --project P [--entity E] [--workspace] [--dry-run]`

Creates a W&B report (or, with --workspace, a saved workspace view) with the panels of
`overlap_tp.training.report`: throughput (TFLOP/s/GPU), tokens/s/GPU, MFU, step time, exposed
communication, communication hidden (overall and per op) and loss, every run of the project side by
side (baseline vs overlap). The metrics are the ones `overlap_tp.training.throughput` and Megatron write (`overlap_tp/...`, `lm loss`).

Needs `pip install wandb wandb-workspaces` and a W&B login (`wandb login` or WANDB_API_KEY). Offline
runs (WANDB_MODE=offline, what the recipes default to) must be uploaded first: `wandb sync
runs/<run>/wandb/wandb/offline-run-*`. `--dry-run` prints the dashboard it would create and needs none of that.
"""
import argparse
import json
import os
import sys

from overlap_tp.training.sampling import SAMPLED_OPS
from overlap_tp.training.throughput import SCALAR_PREFIX

# (title, metric keys, y label). Step = Megatron's iteration (its writers log with step=iteration).
PANELS = (
    ("Throughput", [SCALAR_PREFIX + "tflops_per_gpu"], "TFLOP/s/GPU"),
    ("Tokens", [SCALAR_PREFIX + "tokens_per_sec_per_gpu"], "tokens/s/GPU"),
    ("MFU", [SCALAR_PREFIX + "mfu"], "fraction of peak"),
    ("Step time", [SCALAR_PREFIX + "step_time_ms"], "ms"),
    ("Exposed communication", [SCALAR_PREFIX + "exposed_comm_ms"], "ms per step beyond the GEMMs (>= 0)"),
    ("Communication hidden", [SCALAR_PREFIX + "comm_hidden"], "share of comm-alone time, 0-1"),
    ("Communication hidden by op", [f"{SCALAR_PREFIX}{kind}/comm_hidden" for kind in SAMPLED_OPS],
     "share of comm-alone time, 0-1"),
    ("Exposed communication by op", [f"{SCALAR_PREFIX}{kind}/exposed_comm_ms" for kind in SAMPLED_OPS],
     "ms per step beyond the GEMMs (>= 0)"),
    ("Loss", ["lm loss"], "lm loss"),
)

OFFLINE_HINT = (
    "W&B is offline here ({why}). Upload the offline runs first (`wandb sync runs/<run>/wandb/wandb/"
    "offline-run-*` on a machine with network and a login), then run this again there; `--dry-run` "
    "shows what would be created.")


def plan(project, entity=None, title="overlap_tp: baseline vs overlap", workspace=False):
    """What would be created, as plain data (printed by --dry-run; built by create())."""
    return {"kind": "workspace" if workspace else "report", "entity": entity, "project": project,
            "title": title,
            "panels": [{"title": t, "x": "Step", "y": list(y), "y_label": label} for t, y, label in PANELS]}


def _offline_reason():
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled"):
        return f"WANDB_MODE={os.environ['WANDB_MODE']}"
    return None


def create(spec):
    """Create the report or workspace described by `spec` (from `plan`); returns its URL."""
    try:
        import wandb  # noqa: F401
        import wandb_workspaces.reports.v2 as wr
    except ImportError as error:
        raise SystemExit(f"overlap_tp.training.wandb_dashboard needs wandb and wandb-workspaces ({error}): "
                         "pip install -e '.[wandb]' in the checkout; or use --dry-run")
    panels = [wr.LinePlot(title=p["title"], x=p["x"], y=p["y"]) for p in spec["panels"]]
    if spec["kind"] == "workspace":
        import wandb_workspaces.workspaces as ws
        view = ws.Workspace(name=spec["title"], entity=spec["entity"], project=spec["project"],
                            sections=[ws.Section(name="overlap_tp", panels=panels, is_open=True)])
        view.save()
        return getattr(view, "url", "")
    report = wr.Report(entity=spec["entity"], project=spec["project"], title=spec["title"],
                       description="Baseline (--overlap-tp off) vs overlapped TP/SP runs: throughput, MFU, "
                                   "step time, overlap statistics and loss (overlap_tp.training.throughput).")
    report.blocks = [wr.PanelGrid(runsets=[wr.Runset(entity=spec["entity"], project=spec["project"])],
                                  panels=panels)]
    report.save()
    return getattr(report, "url", "")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m overlap_tp.training.wandb_dashboard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", required=True, help="W&B project the training runs log to (--wandb-project)")
    parser.add_argument("--entity", default=os.environ.get("WANDB_ENTITY"), help="W&B entity (team or user)")
    parser.add_argument("--title", default="overlap_tp: baseline vs overlap")
    parser.add_argument("--workspace", action="store_true", help="a saved workspace view instead of a report")
    parser.add_argument("--dry-run", action="store_true", help="print what would be created; no W&B access")
    options = parser.parse_args(argv)
    spec = plan(options.project, options.entity, options.title, options.workspace)
    if options.dry_run:
        print(json.dumps(spec, indent=2))
        return 0
    why = _offline_reason()
    if why:
        print(OFFLINE_HINT.format(why=why), file=sys.stderr)
        return 2
    url = create(spec)
    print(f"created W&B {spec['kind']}: {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
