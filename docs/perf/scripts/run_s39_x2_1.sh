# Session 39, call 1 (2 GPUs, `nvidia-h200-x2`; ~8 min): `COMMIT=<sha> bash docs/perf/scripts/run_s39_x2_1.sh`
# (carry [".whl", ".ab"]; .ab/old: `mkdir -p .ab/old && git archive 104476e | tar -x -C .ab/old`, session 38's tree).
# Issue 20: the p2p GEMM+ReduceScatter's sum kernel raises SUMMED itself and writes the eager call's number into the
# plan's progress word for the watchdog (kernels/sum_slots.py): 6 -> 4 driver calls per gemm_rs p2p call.
# 1. its GPU tests: gemm_rs (shapes, 200 calls, the watchdog, async_op), every op replayed bitwise, the p2p ops on one
#    GPU, the direct launch of the sum, the 200 back-to-back calls with a late peer (soak);
# 2. host time per call, session 38's tree (old) against this one (new), alternating, two rounds each: predicted
#    gemm_rs p2p 68.5 -> ~57 us (a batched memop ~4 us and an event record ~5-7 us fewer).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s39_x2_1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
tests gemm_rs 110 $REPO/tests/gpu/test_gemm_rs_gpu.py -k "test_gemm_rs or 200_back_to_back or watchdog or async_op"
tests direct 60 $REPO/tests/gpu/test_direct_launch_gpu.py -k sum_slots
rm -rf /tmp/old && python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/old $REPO/.ab/old 2>&1 | tail -1
P=$REPO/docs/perf/scripts/probe_host_t1.py
for i in 1 2; do
  step host_new_$i 50 torchrun --nproc-per-node 2 $P --rounds 10 --only "rs p2p,rs cublas-p2p" --label new
  grep -E "^new op=" $W/host_new_$i.out | cut -c1-420
  step host_old_$i 50 env PYTHONPATH=/tmp/old:/tmp/site torchrun --nproc-per-node 2 $P --rounds 10 \
    --only "rs p2p,rs cublas-p2p" --label old
  grep -E "^old op=" $W/host_old_$i.out | cut -c1-420
done
tests graphs 90 $REPO/tests/gpu/test_graphs_gpu.py -k "every_op_replays or never_replays"
tests p2p_one_gpu 80 $REPO/tests/gpu/test_p2p_one_gpu.py -k "eager or replayed_late_peer or never_calls"
tests soak 80 $REPO/tests/gpu/test_soak_gpu.py
