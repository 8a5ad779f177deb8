# Session 41, call 4 (2 GPUs, `nvidia-h200-x2`; ~7 min): `COMMIT=<sha> bash docs/perf/scripts/run_s41_x2_4.sh`
# (carry [".whl"]). Call 3's layer test through the replays ran past its step limit (200 s for six tests) with no
# watchdog report: slow, or a host-side hang? The in-place gather test alone, with its durations, its workers' stacks
# dumped (SIGABRT, PYTHONFAULTHANDLER) if it is still running after 190 s; if it fails, the same test with the replays
# off (OVERLAP_TP_EAGER_GRAPHS=0); then the token split.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-430}
workdir s41_x2_4
( sleep 190; pkill -ABRT -f spawn_main ) & dumper=$!
tests inplace 230 $REPO/tests/gpu/test_layers_gpu.py -k "gather_in_place_at_the_8b and signal" --durations=0
kill $dumper 2>/dev/null
grep -E "s call|Thread 0x|File .*overlap_tp|File .*tests/gpu" $W/inplace.out | head -60
if ! grep -q "1 passed" $W/inplace.out; then
  OVERLAP_TP_EAGER_GRAPHS=0 tests inplace_eager 150 $REPO/tests/gpu/test_layers_gpu.py \
    -k "gather_in_place_at_the_8b and signal" --durations=0
  grep -E "s call" $W/inplace_eager.out | head
fi
tests split 130 $REPO/tests/gpu/test_layers_gpu.py -k "token_split_matches and signal" --durations=0
grep -E "s call" $W/split.out | head
