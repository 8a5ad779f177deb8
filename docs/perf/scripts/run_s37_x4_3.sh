# Session 37 (4 GPUs; ~3.5 min, the session's last device time): `COMMIT=<sha> bash docs/perf/scripts/run_s37_x4_3.sh`
# (carry [".whl"]). The token split's GPU tests at t = 4 with a comm stream per plan instance (run_s37_x4_2.sh ran them
# on one stream, and its 8B test with a late peer was cut by the step's limit; at t = 2 all passed with the streams).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-200}
workdir s37_x4_3
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step split_tests_t4 170 python3 -m pytest -m gpu -v -rA -s --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_layers_gpu.py -k "token_split and (signal or late_peer)"
grep -E "PASSED|FAILED|ERROR|passed|failed" $W/split_tests_t4.out | grep -v "^\.\./" | cut -c1-300 | tail -4
