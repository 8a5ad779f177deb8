# The next session's first call (2 GPUs; ~7 min), written in session 29: `COMMIT=<sha> bash docs/perf/scripts/run_s30_1.sh`
# (carry [".whl"]). What session 29 changed after its device time ran out, on GPUs.
# 0. GPU tests of the two host-path changes: gemm_rs summed at once on the p2p transport (store_and_reduce: the
#    ARRIVED signal and its wait in one batched driver call) and ag_gemm's copy-engine pulls (the last chunk's flag
#    and the PULLED signal in one batch): every shape against its reference, 200 back-to-back calls, a late peer, the
#    watchdog, async_op; every op replayed bitwise (test_graphs_gpu); the p2p ops on one GPU. Each file its own step
#    (session 29's call 1 lost a test to one shared limit).
#    The two-layer in-place check, now also counting its buffers in ops/symmetric.py's tally.
# 1. The smoke with `--overlap-tp-gather-in-place` for 10 iterations: the training log's new symmetric-memory line.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s30_1
export CUDA_VISIBLE_DEVICES=0,1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
tests() {   # tests NAME SECONDS PYTEST-ARGS...
  local name=$1 limit=$2; shift 2
  step $name $limit python3 -m pytest -m gpu -v -rA --tb=short -p no:cacheprovider "$@"
  grep -E "PASSED|FAILED|ERROR" $W/$name.out | grep -v "^\.\./" | cut -c1-160 | tail -12
}
tests gemm_rs 110 $REPO/tests/gpu/test_gemm_rs_gpu.py -k "test_gemm_rs or 200_back_to_back or watchdog or async_op"
tests ag_gemm 100 $REPO/tests/gpu/test_ag_gemm_gpu.py
tests graphs 80 $REPO/tests/gpu/test_graphs_gpu.py -k "every_op_replays"
tests p2p_one_gpu 70 $REPO/tests/gpu/test_p2p_one_gpu.py -k "eager or replayed_late_peer"
tests in_place 60 $REPO/tests/gpu/test_layers_gpu.py -k "norms_write_into_the_gathered_buffers"
train smoke-memory 50 OVERLAP=signal TRAIN_ITERS=10 -- $REPO/recipes/smoke.sh --overlap-tp-gather-in-place
grep -h "symmetric memory" $W/smoke-memory/train.log | head -2
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
