# Session 35's third four-GPU call (~7 min): `COMMIT=<sha> bash docs/perf/scripts/run_s35_x4_3.sh` (carry [".whl"]).
# chunk_by 'auto' (the AllGathers' copy-engine pulls one peer per chunk where t > 2, the default since this commit):
# 1. its GPU tests at t = 4: test_ag_gemm_gpu at s 8192 and odd shapes (every config, now with p2p/by-rows beside
#    the default p2p, which pulls by peer here), 200 back-to-back calls and a late peer;
# 2. one 8B and one 70B layer at t = 4 under graphs: the default (by peer) against the rows, 4 rounds each;
# 3. 200 graph replays of every op; the in-place layer (8B shapes, 200 small steps with a late peer; the deferred
#    wgrad) bit for bit the staged one, its AllGathers now by peer.
#    Predicted from call 2: the 8B layer -0.06 ms (1.054 -> 1.044 of nocomm); the 70B's AllGathers (l70b.qkv 0.602 ->
#    0.518 ms in call 1) another -0.05 to -0.1 ms.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s35_x4_3
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step ag_tests_t4 150 python3 -m pytest -m gpu -v -rA -s --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_ag_gemm_gpu.py
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/ag_tests_t4.out | grep -v "^\.\./" | cut -c1-200 | tail -6
step layer_t4 200 torchrun --nproc-per-node 4 -m overlap_tp.bench layer --graphs --models l8b,l70b --seq 8192 \
  --configs megatron,nocomm,signal-p2p-inplace-dw,signal-p2p-byrows-inplace-dw --reps 12 --rounds 4 --out $W \
  --name layer_t4_chunk_by
grep -E "^\| l(8|70)b " $W/layer_t4_chunk_by.md | cut -c1-200
step graphs_t4 80 python3 -m pytest -m gpu -v -rA -s --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_graphs_gpu.py -k "every_op_replays"
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/graphs_t4.out | grep -v "^\.\./" | cut -c1-200 | tail -3
step inplace_t4 130 python3 -m pytest -m gpu -v -rA -s --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_layers_gpu.py -k "(8b_layer_shape or deferred_fc1) and signal"
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/inplace_t4.out | grep -v "^\.\./" | cut -c1-200 | tail -4
