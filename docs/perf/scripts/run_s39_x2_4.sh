# Session 39, call 4 (2 GPUs, `nvidia-h200-x2`; ~4 min): `COMMIT=<sha> bash docs/perf/scripts/run_s39_x2_4.sh`
# (carry [".whl"]). What call 3's layer step did not reach within its limit: the token split with method decompose and
# at the 8B layer's shapes with a late peer (session 38's review commit and this session's deferred sums).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-400}
workdir s39_x2_4
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
step split 300 python3 -m pytest -m gpu -v -rA --tb=short -p no:cacheprovider $REPO/tests/gpu/test_layers_gpu.py \
  -k "token_split and (decompose or late_peer)"
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $W/split.out | cut -c1-160 | tail -4
