# Session 35's second four-GPU call (~5 min): `COMMIT=<sha> bash docs/perf/scripts/run_s35_x4_2.sh` (carry [".whl"]).
# The rest of run_s34_2.sh: one 8B layer at t = 4 under graphs, signal-p2p-inplace-dw (session 32: 0.897 of
# Megatron's) against the same with chunk_by 'peer', 4 rounds; then 200 graph replays of every op at t = 4.
# Predicted, if the copies set the per-chunk cost: the layer -0.05 to -0.1 ms with by-peer. (Ran at 6605e2c; since,
# chunk_by 'auto' makes signal-p2p-inplace-dw pull by peer at t > 2, and the rows are signal-p2p-byrows-inplace-dw.)
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s35_x4_2
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step layer_t4 150 torchrun --nproc-per-node 4 -m overlap_tp.bench layer --graphs --models l8b --seq 8192 \
  --configs megatron,nocomm,signal-p2p-inplace-dw,signal-p2p-bypeer-inplace-dw --reps 16 --rounds 4 --out $W \
  --name layer_t4_bypeer
grep -E "^\| l8b " $W/layer_t4_bypeer.md | cut -c1-200
step graphs_t4 160 python3 -m pytest -m gpu -v -rA -s --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_graphs_gpu.py -k "every_op_replays"
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/graphs_t4.out | grep -v "^\.\./" | cut -c1-200 | tail -3
