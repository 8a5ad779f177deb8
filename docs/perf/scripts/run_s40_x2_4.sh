# Session 40, call 4 (2 GPUs, `nvidia-h200-x2`; ~5 min): `COMMIT=<sha> bash docs/perf/scripts/run_s40_x2_4.sh`
# (carry [".whl"]). Issue 20: host time per call in a run of calls (tune.timing.enqueue_us: 24 calls timed after 8
# untimed ones, behind a sleep) against one call alone after a synchronize, for the three ops' default configs
# (`bench ops --host`), and how the time per call falls along a run of 64 calls (probe_host_parts.py).
# Calls 2-3 (inline, 49b1374..cdb0c17) found the first calls after a synchronize 2-5x slower than later ones.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s40_x2_4
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step parts 150 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_host_parts.py --rounds 20 --burst 8
grep -v "^W1\|^\*\*\*\|OMP_NUM\|[Ww]arn" $W/parts.out | tail -28
step ops_host 400 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --ops rs,ar,ag --shapes l8b.proj \
  --ag-shapes l8b.qkv --seq 8192 --ag-seq 8192 --ar-seq 8192 --host --reps 20 --out $W --name ops_host_t2
grep -E "^\|" $W/ops_host_t2.md | cut -c1-600
