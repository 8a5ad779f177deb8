# Session 34, call 3 (2 GPUs, `nvidia-h200-x2`; ~3 min): `COMMIT=<sha> bash docs/perf/scripts/run_s34_x2_3.sh`
# (carry [".whl"]). Call 2's timelines of the smoke's AllGather+GEMM: the pulls start ~16 us after the stage copy and
# the GEMM ends ~15 us after the last pull. (1) What a handshake, a small copy and a cross-stream edge cost inside a
# graph (probe_signal_latency.py). (2) The tail: at M 4096 the 128x256 tile makes one wave (96 tiles at qkv), so the
# peer's rows take a whole tile-time (~9 us at K 1024) after they land; the 128x128 tile halves it. Predicted: the
# narrow tile -4 to -5 us per AllGather+GEMM at smoke.qkv.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s34_x2_3
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step latency 120 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_signal_latency.py --reps 64
grep -vE "^W1127|Warning|warn" $W/latency.out | tail -20
P=$REPO/docs/perf/scripts/probe_op_timeline.py
step tl_ag_qkv 100 torchrun --nproc-per-node 2 $P --op ag --shape 4096,1024,768 --variants ours,narrow,g1,narrow-g1
step tl_ag_fc1 90 torchrun --nproc-per-node 2 $P --op ag --shape 4096,1024,2816 --variants ours,narrow,narrow-g1
for f in tl_ag_qkv tl_ag_fc1; do echo "=== $f"; grep -E "^## |^  " $W/$f.out | head -80; done
