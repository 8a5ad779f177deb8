"""Every timed variant of a `bench ops` JSON, one line per shape (the Markdown table shows the best one only):

    python3 docs/perf/scripts/ops_variants.py OPS.json
"""
import json
import sys

for row in json.load(open(sys.argv[1]))["rows"]:
    variants = {name: round(ms, 3) for name, ms in row.get("variants", {}).items()}
    print(row["op"], row["shape"], "seq", round(row["seq"], 3), "async-TP", round(row.get("async_tp") or 0, 3),
          "ours", round(row["ours"], 3), variants)
