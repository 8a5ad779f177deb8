# Session 20's fourth 2-GPU call (~9 min), after run_s19_x2_{1,2,3}.sh ran on an H100 pair:
# - test_ag_gemm_gpu.py after its fix (the loop held the previous config's gathered buffer into the next call of the
#   shape: the p2p transport's named RuntimeError, 4 of 4 shape tests failed in call 3) and with cuBLAS over p2p;
# - the MLP-boundary layer check under decompose-p2p (call 2's test_layers_gpu.py ran out of its 200 s in it, after
#   7 passed: slow or stuck, -v says which);
# - every op captured and replayed bitwise, the decompose-p2p cases new;
# - issue 25: the MoE layer at EP 2 over NVLink, a new routing every step: signal, signal-p2p, decompose-p2p, off, auto.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s20_x2_4
step ag_tests 150 python3 -m pytest -m gpu -v -rA --tb=short $REPO/tests/gpu/test_ag_gemm_gpu.py -p no:cacheprovider \
  --durations=0
grep -E "PASSED|FAILED|ERROR|passed|failed|Error" $W/ag_tests.out | tail -12
step boundary 100 python3 -m pytest -m gpu -v -rA --tb=short $REPO/tests/gpu/test_layers_gpu.py -k "mlp_boundary" \
  -p no:cacheprovider --durations=0
grep -E "PASSED|FAILED|ERROR|passed|failed|s call" $W/boundary.out | tail -8
step moe_nvlink 190 torchrun --nproc-per-node 2 -m overlap_tp.bench moe_layer --tokens 8192 --routings 8 \
  --methods signal,signal-p2p,decompose-p2p,off,auto --out $W --name moe_layer_nvlink
grep -E "^\| |^- " $W/moe_layer_nvlink.md | head -16
step replays 90 python3 -m pytest -m gpu -v -rA --tb=short $REPO/tests/gpu/test_graphs_gpu.py -k "every_op_replays" \
  -p no:cacheprovider --durations=0
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/replays.out | tail -4
