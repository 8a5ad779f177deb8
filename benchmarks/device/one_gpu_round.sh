#!/usr/bin/env bash
# One device call on one GPU that does what needs one GPU, in order of what depends on it, from the repository root:
#   COMMIT=<sha> bash benchmarks/device/one_gpu_round.sh          carry: [".whl", ".te"], call timeout 598
#   (once .te/torch-ext/ holds a kept build, carry its parts without the build inputs, as te_build.sh says, which
#   keeps the call under its 64 MiB: [".whl", ".te/wheels", ".te/torch-ext", ".te/te-core-sm90.tar.xz",
#   ".te/transformer_engine-2.20.2-py3-none-any.whl"])
#   1. the whole one-GPU suite (the gate: tests/gpu/gpu_suite.py run, at most SUITE_S = 390 s), while Transformer
#      Engine's PyTorch extension builds in the background at a lower priority (te_build.sh; skipped when
#      .te/torch-ext/ holds a kept build);
#   2. with Transformer Engine: tests/gpu/test_te_gpu.py and the MLA layer's CUDA-graph replay (test_mla_gpu.py's
#      captured test), beside
#   3. the new model recipes' first steps at TP 1 (deepseek-v3-proxy, qwen3-moe-proxy: 2 layers, 3 iterations),
#   4. the FP8 loss curves (fp8_curves.py: bf16, e4m3 blockwise and tensorwise) with the time left.
# A step that would end after DEADLINE_S (586) is skipped (setup.sh). Back in $OUT (at most 8 files):
#   suite.tgz (the suite's chunk-*.json and logs: `python tests/gpu/gpu_suite.py summary suite/chunk-*.json` here),
#   te_build.log, transformer_engine_torch-*.whl.part-* (a fresh build: copy them to .te/torch-ext/),
#   checks.tgz (steps 2-4: their outputs, train.log files, fp8_curves.*), cards.txt.
COMMIT=${COMMIT:?set COMMIT to the commit under test}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export OUT
(export MAX_JOBS=${MAX_JOBS:-10}; nice -n 10 bash benchmarks/device/te_build.sh > "$OUT/te_build.log" 2>&1
 echo "te_build.sh exit $? at ${SECONDS}s" >> "$OUT/te_build.log") &
build=$!
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
timeout -s INT "${SUITE_S:-390}" python3 tests/gpu/gpu_suite.py run --jobs "${JOBS:-6}" --commit "$COMMIT" \
  --out /tmp/suite --logs /tmp/logs --limit $(( ${SUITE_S:-390} - 10 ))
tar czf "$OUT/suite.tgz" -C /tmp suite logs
echo "suite ended at ${SECONDS}s"
export DEADLINE_S=${DEADLINE_S:-586}
source benchmarks/device/setup.sh
timeout $(( SECONDS < 395 ? 395 - SECONDS : 1 )) tail --pid=$build -f /dev/null
tail -12 "$OUT/te_build.log"
echo "Transformer Engine build waited for until ${SECONDS}s"
workdir checks
(export PYTHONPATH=/tmp/te-site:$PYTHONPATH UB_SKIPMC=1
 tests te_gpu $(( DEADLINE_S - 6 - SECONDS )) "$REPO/tests/gpu/test_te_gpu.py" \
   "$REPO/tests/gpu/test_mla_gpu.py::test_mla_layer_captured_replays_bit_for_bit_at_t2_on_one_gpu") &
te_tests=$!
for recipe in deepseek-v3-proxy qwen3-moe-proxy; do
  train "$recipe" 85 TP=1 EP=1 NUM_LAYERS=2 TRAIN_ITERS=3 LOG_INTERVAL=1 WANDB_PROJECT= MASTER_PORT=29611 \
    -- "$REPO/recipes/$recipe.sh"
  grep -hE "iteration +[0-9]|Error|rror:" "$W/$recipe/train.log" "$W/$recipe.out" 2>/dev/null | tail -4
done
if fits curves 60; then
  timeout $(( DEADLINE_S - 8 - SECONDS )) python3 "$REPO/benchmarks/device/fp8_curves.py" --out "$W" \
    --runs bf16,e4m3/blockwise,e4m3/tensorwise 2>&1 | grep -v -i warn | tail -5
fi
wait $te_tests
echo "ended at ${SECONDS}s"
