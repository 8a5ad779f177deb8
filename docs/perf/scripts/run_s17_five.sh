# Session 17, call 5 (ONE GPU): the copy-engine re-gather (gather_rows / RowGather) and the OverlapTransformerLayer
# at TP 2 captured forward + backward, with the rest of test_p2p_one_gpu.py (two processes on one GPU); the layer
# and one-GPU op tests after the layers' change. Call 5a: the layer capture failed (cudaErrorStreamCaptureImplicit:
# the test kept its eager outputs with their autograd graph; now detached), everything else passed.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= OVERLAP_TP_WATCHDOG_S=120
workdir s17_five
step p2p_one_gpu 420 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_p2p_one_gpu.py -p no:cacheprovider ${K:+-k $K}
grep -E "PASSED|FAILED|passed|failed|Error" $W/p2p_one_gpu.out | head -24
