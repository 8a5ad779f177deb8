# Which tensors of two Megatron torch_dist checkpoints differ, bit for bit (issue 24: what a resumed run's state
# differs in). Each checkpoint folder (iter_NNNNNNN) is read whole on the CPU: its tensors through
# torch.distributed.checkpoint (no process group, no model needed) and its common.pt where there is one (scheduler, the optimizer's
# common step, rng, args). Prints one line per differing tensor (elements differing, largest absolute and relative
# difference), counts of equal ones by kind (model weights, fp32 main params, Adam moments, other), and the
# common.pt entries that differ.
#   python docs/perf/scripts/compare_checkpoints.py CKPT_A/iter_0000011 CKPT_B/iter_0000011
import argparse
import os
import tempfile

import numpy
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

# entries of common.pt that differ between any two runs (wall times, paths, the arguments of the run)
VOLATILE = ("args", "checkpoint_version", "num_floating_point_operations_so_far", "rerun_state_machine",
            "content_metadata")


def tensors(folder):
    with tempfile.TemporaryDirectory() as tmp:
        flat = os.path.join(tmp, "flat.pt")
        try:
            dcp_to_torch_save(folder, flat)
            state = torch.load(flat, map_location="cpu", weights_only=False)
        except Exception as error:   # a layout torch's reader does not take whole: Megatron's own plain reader
            print(f"{folder}: torch.distributed.checkpoint could not read it whole ({error}); megatron's "
                  "load_plain_tensors instead")
            from megatron.core.dist_checkpointing import load_plain_tensors
            state = load_plain_tensors(folder)
    return dict(_flatten(state))


def _flatten(value, prefix=""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flatten(item, f"{prefix}{key}.")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _flatten(item, f"{prefix}{i}.")
    else:
        yield prefix[:-1], value


def kind(name):
    if "fp32_param" in name:
        return "fp32 main params"
    if "exp_avg_sq" in name:
        return "Adam exp_avg_sq"
    if "exp_avg" in name:
        return "Adam exp_avg"
    if name.startswith(("decoder.", "embedding.", "output_layer.")):
        return "model weights"
    return "other"


def differs(a, b):
    """None where equal, else a description."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
        if torch.equal(a, b):
            return None
        a64, b64 = a.double(), b.double()
        diff = (a64 - b64).abs()
        rel = float(diff.max() / b64.abs().max().clamp_min(1e-30))
        return f"{int((a != b).sum())} of {a.numel()} elements differ, max |a-b| {float(diff.max()):.3g} (rel {rel:.3g})"
    if type(a) is not type(b):
        return f"{type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, numpy.ndarray):   # the numpy rng state
        return None if numpy.array_equal(a, b) else f"{int((a != b).sum())} of {a.size} elements differ"
    try:
        return None if a == b else f"{a!r} vs {b!r}"
    except Exception as error:   # objects without a usable ==
        return f"not comparable ({error})"


def compare(a: dict, b: dict, label: str, skip=()):
    equal, lines = {}, []
    for name in sorted(set(a) | set(b)):
        if name.split(".")[0] in skip:
            continue
        if name not in a or name not in b:
            lines.append(f"  {name}: only in {'A' if name in a else 'B'}")
            continue
        what = differs(a[name], b[name])
        if what is None:
            equal[kind(name)] = equal.get(kind(name), 0) + 1
        else:
            lines.append(f"  {name} [{kind(name)}]: {what}")
    print(f"{label}: {len(lines)} differ; equal: " + ", ".join(f"{k} {n}" for k, n in sorted(equal.items())))
    for line in lines:
        print(line)
    return len(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("a")
    parser.add_argument("b")
    args = parser.parse_args()
    found = compare(tensors(args.a), tensors(args.b), "tensors", skip=VOLATILE)
    if all(os.path.exists(os.path.join(folder, "common.pt")) for folder in (args.a, args.b)):   # older layouts
        commons = [dict(_flatten(torch.load(os.path.join(folder, "common.pt"), map_location="cpu",
                                            weights_only=False))) for folder in (args.a, args.b)]
        found += compare(*commons, "common.pt", skip=VOLATILE)
    print("identical" if not found else f"{found} entries differ")


if __name__ == "__main__":
    main()
