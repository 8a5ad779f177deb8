# Host time of one routing's expert plans on the CPU alone (no GPU): layout + dispatch_plan + combine_plan, zipf routing, 8192
# tokens, parts 4, median of 40 routings (best of 5). Runs against either plan signature, so an older commit can be timed
# from a worktree: (cd WORKTREE && PYTHONPATH=. python /path/to/probe_plan_host_cpu.py)
import time, statistics, inspect
from overlap_tp.ops import moe_tile_plan as m
from overlap_tp.bench.moe import routing_counts
new = "lay" in str(inspect.signature(m.dispatch_plan))
for ep,E in [(1,4),(2,8),(4,32),(8,64)]:
    cs=[routing_counts(8192,E,ep,"zipf",seed=s) for s in range(40)]
    def one(c):
        if new:
            l=m.layout(c,0); m.dispatch_plan(l,2816,128,128,4); m.combine_plan(l,4096,128,128,4)
        else:
            m.layout(c,0); m.dispatch_plan(c,0,2816,128,128,4); m.combine_plan(c,0,4096,128,128,4)
    best=1e9
    for rep in range(5):
        ts=[]
        for c in cs:
            t=time.perf_counter(); one(c); ts.append((time.perf_counter()-t)*1e6)
        best=min(best, statistics.median(ts))
    print(f"ep{ep} E{E}: layout+dispatch+combine {best:.0f} us")
