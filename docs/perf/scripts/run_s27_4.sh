# Session 27's fourth call (2 GPUs; ~8 min): `COMMIT=<sha> bash docs/perf/scripts/run_s27_4.sh`. The expert ops' and
# the MoE layer's GPU tests after the signaled GEMM's routing integers were unspecialized and row-tile plans got a
# fixed grid and group search (36620b4); run_s27_3.sh's test step ran out of time inside the first expert-op case.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=470
workdir s27_4
export CUDA_VISIBLE_DEVICES=0,1
step moe_tests 300 python3 -m pytest -m gpu -v -rA --durations=0 --tb=short $REPO/tests/gpu/test_moe_ops_gpu.py \
  $REPO/tests/gpu/test_direct_launch_gpu.py -k "not norm_kernels" -p no:cacheprovider
grep -E "PASSED|FAILED|ERROR|passed|failed|s call" $W/moe_tests.out | grep -v "^\.\./" | cut -c1-200 | tail -30
step moe_layer_tests 150 python3 -m pytest -m gpu -v -rA --durations=0 --tb=short $REPO/tests/gpu/test_moe_layer_gpu.py \
  -p no:cacheprovider
grep -E "PASSED|FAILED|ERROR|passed|failed|s call" $W/moe_layer_tests.out | grep -v "^\.\./" | cut -c1-200 | tail -14
