# Session 31's third call (run on GPUs 0-1 of a 4 x H200 host; 318 s), written in session 30: `COMMIT=<sha> bash
# docs/perf/scripts/run_s31_3.sh` (carry [".whl"]). README's main job as a user runs it twice: the smoke with its
# default (auto, since session 30) into one OUT_DIR. The first run tunes and writes runs' overlap_tp_tune.json
# (TUNE_CACHE's default, new in session 30); the second must take every decision "from the cache" and start sooner.
# Then the token-split probe at t = 2 (docs/fused_block.md, Token split); then auto gathering in place (new in session
# 30, CPU-tested): its GPU test, and the smoke with OVERLAP=auto --overlap-tp-gather-in-place (its log names what the
# tuner picked and the symmetric memory the in-place buffers took).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=585
workdir s31_3
export CUDA_VISIBLE_DEVICES=0,1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
for i in 1 2; do
  t0=$SECONDS
  env OUT_DIR=$W/smoke-auto TRAIN_ITERS=12 LOG_INTERVAL=2 timeout -s KILL 130 bash $REPO/recipes/smoke.sh \
    > $W/smoke-auto-$i.out 2>&1
  echo "run $i: exit $? after $((SECONDS - t0)) s; auto decisions: $(grep -c 'measured here' $W/smoke-auto-$i.out) measured, $(grep -c 'from the cache' $W/smoke-auto-$i.out) from the cache"
done
ls -l $W/smoke-auto/overlap_tp_tune.json
# The token-split probe at t = 2 (probe_token_split.py), on Megatron's one hardware queue and on eight
for connections in 1 8; do
  step probe_split_c$connections 45 env CUDA_DEVICE_MAX_CONNECTIONS=$connections torchrun --nproc-per-node 2 \
    $REPO/docs/perf/scripts/probe_token_split.py --attn
  grep -h -E "^(t = |eager|graph)" $W/probe_split_c$connections.out
done
step auto_inplace_test 120 python3 -m pytest -m gpu -v -rA --tb=short -p no:cacheprovider \
  $REPO/tests/gpu/test_layers_gpu.py -k "auto_gathers_in_place"
grep -E "PASSED|FAILED|passed|failed" $W/auto_inplace_test.out | grep -v "^\.\./" | cut -c1-200 | tail -3
train smoke-auto-inplace 100 OVERLAP=auto TRAIN_ITERS=12 LOG_INTERVAL=2 -- $REPO/recipes/smoke.sh --overlap-tp-gather-in-place
grep -h -E "\[overlap_tp\] (auto:|symmetric memory)|gather in place" $W/smoke-auto-inplace/train.log | sort -u | cut -c1-200
grep -h -E "Error|error:|Traceback" $W/smoke-auto-*.out $W/smoke-auto-inplace/train.log | sort | uniq -c | head -8
