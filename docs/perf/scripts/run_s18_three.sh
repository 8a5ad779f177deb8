# Session 18, call 3 (ONE GPU): the AllGather's one gathered buffer per shard shape (GatherBuffer): the p2p tests at
# t = 2 on one GPU that run ag_gemm / gather_rows / the layers, the ops at t = 1, then the p2p plans' host time at
# t = 2 (probe_host_t1.py --one-gpu), this commit against the session's previous code (c10dd3e, carried as .ab/old)
# one after the other, twice (A B A B), each with its own bare-cuBLAS baseline in the same rounds.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= OVERLAP_TP_WATCHDOG_S=120
workdir s18_three
step p2p_one_gpu 330 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_p2p_one_gpu.py -p no:cacheprovider \
  -k "eager or replayed_late_peer or gather_rows or layer_captured or soak or check_deferred_proj_sum or check_mlp_boundary"
grep -E "PASSED|FAILED|passed|failed|Error" $W/p2p_one_gpu.out | head -14
step ops_t1 90 python3 -m pytest -m gpu -q -rA -x $REPO/tests/gpu/test_ops_one_gpu.py -p no:cacheprovider
grep -E "passed|failed" $W/ops_t1.out | tail -2
for pass in 1 2; do
  step probe_old_$pass 60 env PYTHONPATH=$REPO/.ab/old:/tmp/site torchrun --nproc-per-node 2 \
    $REPO/docs/perf/scripts/probe_host_t1.py --one-gpu --rounds 20 --label before
  step probe_new_$pass 60 torchrun --nproc-per-node 2 $REPO/docs/perf/scripts/probe_host_t1.py --one-gpu --rounds 20 --label after
done
grep -h -E "^(before|after) " $W/probe_*.out
