"""Benchmark and tuner records: JSON plus a Markdown table, with the environment they were measured in."""
import datetime
import json
import os
import platform
import subprocess
import sys


def environment(command=None):
    """Device, software versions, git commit and the command line: what every benchmark record must carry."""
    import torch

    env = {
        "date": datetime.date.today().isoformat(),
        "command": command or " ".join(["python", "-m", "overlap_tp.bench"] + sys.argv[1:]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "multicast_env": {k: os.environ.get(k) for k in
                          ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")},
    }
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["device_count"] = torch.cuda.device_count()
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    # The device machines get a copy of the working tree without .git: the launcher passes the commit.
    env["git_commit"] = os.environ.get("OVERLAP_TP_GIT_COMMIT")
    if not env["git_commit"]:
        try:
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env["git_commit"] = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                                               text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            env["git_commit"] = "unknown"
    return env


def markdown_table(rows, columns):
    """rows: list of dicts; columns: list of (key, header, format) with format like '{:.3f}'."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for key, _, fmt in columns:
            value = row.get(key)
            cells.append("-" if value is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(out_dir, name, title, rows, columns, notes="", command=None):
    """Write `<name>.json` (environment + rows) and `<name>.md` (environment + table + notes)."""
    os.makedirs(out_dir, exist_ok=True)
    env = environment(command)
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump({"environment": env, "rows": rows}, f, indent=1)
    header = "\n".join(f"- {k}: `{v}`" for k, v in env.items())
    with open(os.path.join(out_dir, name + ".md"), "w") as f:
        f.write(f"# {title}\n\n{header}\n\n{markdown_table(rows, columns)}\n")
        if notes:
            f.write("\n" + notes.strip() + "\n")
    return env
