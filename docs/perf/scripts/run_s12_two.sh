# Session 12, call 2 (nvidia-h200, ONE GPU). Carry .whl and .old (git archive of 1e5cf38, the code before the
# expert ops' pinned tables): the MoE step's host time with a new routing before / after; the expert ops' new
# one-GPU tests; the grouped GEMM alone (per-expert cuBLAS, torch._grouped_mm, signaled); host time per op
# call at t = 1, warm (bursts) and cold (bench ops' single call).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s12_two
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/old $REPO/.old 2>&1 | grep -v -i warn | tail -2
step gpu_moe 200 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_moe_ops_one_gpu.py -p no:cacheprovider
step moe 150 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_moe_one_gpu.py
step moe_old 60 env PYTHONPATH=/tmp/old:$PYTHONPATH torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_moe_one_gpu.py --host-only
step host 150 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_host_t1.py --profile
grep -E "passed|failed" $W/gpu_moe.out | tail -3; grep -E "^\||^MoE|grouped_mm:" $W/moe.out; grep -E "^MoE" $W/moe_old.out
grep -E "^memop|^op=" $W/host.out
