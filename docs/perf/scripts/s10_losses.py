"""Compare the per-iteration losses of Megatron training logs (run_s10_faults.sh).

    python3 s10_losses.py REFERENCE.log OTHER.log --first 11 --last 30 --label "resumed (torch_dist)"

Reads Megatron's iteration lines (`iteration   N/  M | ... | lm loss: X | ... | grad norm: Y | ...`, which
need --log-interval 1 to give every iteration), compares OTHER's iterations first..last with REFERENCE's,
prints one Markdown table row (label, iterations compared, identical, max |relative difference| of the loss
and of the grad norm) and exits 0 only when every iteration is present in both and identical as printed
(Megatron prints the loss with 7 significant digits and the grad norm with 3 decimals, so "identical" is
identical to that precision). `--header` prints the table's header first.

`--mixed-loss N` leaves iteration N's loss out of the comparison (its grad norm stays in): megatron-core 0.19 logs a
run's first iteration without resetting its loss accumulators (`training_log(is_first_iteration=True)`), so with
--log-interval 1 the loss printed for a run's second iteration is the mean of its first two. A run resumed at
iteration R prints that mean at R + 1, where the uninterrupted reference prints R + 1's own loss (session 22: the
resumed smoke run's 1.933953 at iteration 12 is exactly the mean of 2.318341 and 1.549602).
"""
import argparse
import re
import sys

LINE = re.compile(r"\biteration\s+(\d+)/\s*\d+\s*\|.*?\blm loss: ([0-9.eE+-]+)\s*\|.*?\bgrad norm: ([0-9.eE+-]+)\s*\|")
HEADER = ("| run | iterations | identical | max rel. diff loss | max rel. diff grad norm | verdict |\n"
          "|---|---|---|---|---|---|")


def iterations(path):
    """{iteration: (loss text, grad norm text)}; a later line for the same iteration wins."""
    out = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.search(line)
            if m:
                out[int(m.group(1))] = (m.group(2), m.group(3))
    return out


def rel(a, b):
    a, b = float(a), float(b)
    return abs(a - b) / max(abs(b), 1e-30)


def compare(reference, other, first, last, mixed_loss=()):
    """(row cells, ok) for iterations first..last, the losses of the iterations in mixed_loss left out."""
    wanted = range(first, last + 1)
    missing = [i for i in wanted if i not in reference or i not in other]
    both = [i for i in wanted if i in reference and i in other]

    def agree(i):
        return reference[i][1] == other[i][1] and (i in mixed_loss or reference[i][0] == other[i][0])

    same = sum(agree(i) for i in both)
    loss = max((rel(other[i][0], reference[i][0]) for i in both if i not in mixed_loss), default=float("nan"))
    norm = max((rel(other[i][1], reference[i][1]) for i in both), default=float("nan"))
    ok = not missing and same == len(both)
    verdict = "identical" if ok else (f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}" if missing
                                      else "differs")
    return [f"{first}-{last}", f"{same}/{len(wanted)}", f"{loss:.3g}", f"{norm:.3g}", verdict], ok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reference")
    p.add_argument("other")
    p.add_argument("--first", type=int, required=True)
    p.add_argument("--last", type=int, required=True)
    p.add_argument("--label", default="")
    p.add_argument("--header", action="store_true")
    p.add_argument("--mixed-loss", type=int, action="append", default=[],
                   help="an iteration whose printed loss is Megatron's mean of two (see above): not compared")
    args = p.parse_args(argv)
    cells, ok = compare(iterations(args.reference), iterations(args.other), args.first, args.last, args.mixed_loss)
    if args.mixed_loss:
        cells[0] += f" (loss of {', '.join(map(str, args.mixed_loss))} not compared)"
    if args.header:
        print(HEADER)
    print("| " + " | ".join([args.label or args.other] + cells) + " |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
