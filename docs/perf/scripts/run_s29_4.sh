# Session 29's third call (ONE GPU; ~4 min): `COMMIT=<sha> bash docs/perf/scripts/run_s29_4.sh`. Call 1's
# test_p2p_one_gpu check_gather_in_place[signal] (two processes on one GPU over CUDA IPC) hung until its limit while
# the same check passed on two GPUs; pytest captured the children's output, so their stacks were lost. Here without
# capture (-s): a child's error and, at the limit, every process's stack land in the .out. The MLP-boundary check
# (passed on one GPU in s17) runs first as the control.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONFAULTHANDLER=1 DEADLINE_S=560
workdir s29_4
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
T=$REPO/tests/gpu/test_p2p_one_gpu.py::test_transformer_layers_on_the_p2p_transports_at_t2_on_one_gpu
step control 150 python3 -m pytest -m gpu -s -v -rA --tb=short "$T[check_mlp_boundary-signal]" -p no:cacheprovider
step in_place_signal 200 python3 -m pytest -m gpu -s -v -rA --tb=long "$T[check_gather_in_place-signal]" -p no:cacheprovider
step in_place_decompose 150 python3 -m pytest -m gpu -s -v -rA --tb=long "$T[check_gather_in_place-decompose]" -p no:cacheprovider
for f in in_place_signal in_place_decompose; do
  echo "== $f"; grep -n -E "Error|error|Traceback|assert|File \"/(work|tmp/site)" $W/$f.out | grep -v "site-packages/_pytest\|pluggy" | head -40 | cut -c1-220
done
