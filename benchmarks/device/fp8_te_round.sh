#!/usr/bin/env bash
# One device call on one GPU for the FP8 and Transformer Engine measurements that need no gate, from the repository
# root:   COMMIT=<sha> bash benchmarks/device/fp8_te_round.sh          carry: [".te", ".whl"]; call timeout 598
#   - in the background, at a lower priority: Transformer Engine's PyTorch extension (te_build.sh: the kept build in
#     .te/torch-ext/ when there is one, else built and returned in $OUT as transformer_engine_torch-*.whl.part-*,
#     for .te/torch-ext/ here);
#   - on the GPU meanwhile: the blockwise FP8 GEMM's main-loop variants (the Gluon kernel among them) against
#     cuBLAS, one and two programs per SM
#     (fp8_blockwise_variants.py, at most VARIANTS_S = 180 s), then the FP8 loss curves (fp8_curves.py: bf16, e4m3
#     blockwise and tensorwise; at most CURVES_S = 170 s; `fp8_curves.py --render` here makes the rows and the plot
#     from fp8_curves.partial.jsonl if the limit ended it);
#   - once TE imports: tests/gpu/test_te_gpu.py and the MLA layer's CUDA-graph replay, until DEADLINE_S (586).
# Back in $OUT: res.tgz (every output and log: fp8_blockwise_variants.jsonl, fp8_curves.*, te_build.log,
# te_gpu.out), cards.txt, and the wheel parts of a fresh TE build.
COMMIT=${COMMIT:?set COMMIT to the commit under test}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export OUT COMMIT
R=/tmp/res; rm -rf "$R"; mkdir -p "$R"
(export MAX_JOBS=${MAX_JOBS:-12}; nice -n 10 bash benchmarks/device/te_build.sh > "$R/te_build.log" 2>&1
 echo "te_build.sh exit $? at ${SECONDS}s" >> "$R/te_build.log") &
build=$!
trap 'cp -f "$OUT/cards.txt" "$R/" 2>/dev/null; tar czf "$OUT/res.tgz" -C /tmp res' EXIT
export DEADLINE_S=${DEADLINE_S:-586}
source benchmarks/device/setup.sh
echo "setup done at ${SECONDS}s"
timeout "${VARIANTS_S:-180}" python3 "$REPO/benchmarks/device/fp8_blockwise_variants.py" --out "$R" 2>&1 \
  | grep -v -i warn | tail -24
echo "variants done at ${SECONDS}s"
timeout "${CURVES_S:-170}" python3 "$REPO/benchmarks/device/fp8_curves.py" --out "$R" \
  --runs bf16,e4m3/blockwise,e4m3/tensorwise 2>&1 | grep -v -i warn | tail -6
echo "curves done at ${SECONDS}s"
timeout $(( SECONDS < DEADLINE_S - 120 ? DEADLINE_S - 120 - SECONDS : 1 )) tail --pid=$build -f /dev/null
tail -10 "$R/te_build.log"
if kill -0 $build 2> /dev/null; then echo "Transformer Engine still building at ${SECONDS}s: its checks skipped"; exit 0; fi
W=$R
export PYTHONPATH=/tmp/te-site:$PYTHONPATH UB_SKIPMC=1
tests te_gpu $(( DEADLINE_S - 4 - SECONDS )) "$REPO/tests/gpu/test_te_gpu.py" \
  "$REPO/tests/gpu/test_mla_gpu.py::test_mla_layer_captured_replays_bit_for_bit_at_t2_on_one_gpu"
echo "ended at ${SECONDS}s"
