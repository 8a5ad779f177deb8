# Session 33's fourth call (4 GPUs, `nvidia-h200-x4`; ~3 min, the device time left): `COMMIT=<sha> bash
# docs/perf/scripts/run_s33_4.sh` (carry [".whl"]). Why our AllGather+GEMM trails PyTorch's async-TP at t = 4: on
# l8b.qkv under graphs s21-s23 measured ours 0.297-0.321 ms against async-TP's 0.218-0.225 (the pulls alone 0.19,
# cuBLAS 0.135). Both should end one chunk's GEMM after the last rows arrive (~0.23 ms with our 3 chunks of 16 MB);
# ours ends ~0.08 ms later. The chunk count was never swept at t = 4: --sweep adds g2 / g4 / g8 (auto: 3) and the
# NCCL variants. If g8 closes the gap, the wait is the chunk's granularity; if not, it is elsewhere (the start).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-200}
workdir s33_4
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step ops_ag_t4 170 torchrun --nproc-per-node 4 -m overlap_tp.bench ops --graphs --ops ag --ag-shapes l8b.qkv \
  --ag-seq 8192 --reps 30 --sweep --out $W --name ops_ag_t4_sweep
python3 - "$W/ops_ag_t4_sweep.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["shape"], {k: round(r[k], 4) for k in ("seq", "gemm", "comm", "async_tp", "ours") if k in r},
          {k: round(v, 4) for k, v in r.get("variants", {}).items()})
PY
