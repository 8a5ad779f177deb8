#!/usr/bin/env bash
# One device call on one GPU for the FP8 and Transformer Engine measurements that need no gate, from the repository
# root:   COMMIT=<sha> bash benchmarks/device/fp8_te_round.sh          carry: [".te", ".whl"]; call timeout 598
#   (with a kept build in .te/torch-ext/, carry one_gpu_round.sh's list instead)
#   - in the background, at a lower priority: Transformer Engine's PyTorch extension (te_build.sh: the kept build in
#     .te/torch-ext/ when there is one, else built and returned in $OUT as transformer_engine_torch-*.whl.part-*,
#     for .te/torch-ext/ here);
#   - on the GPU meanwhile: the blockwise FP8 GEMM's main-loop variants against cuBLAS, one and two programs per SM
#     (fp8_blockwise_variants.py: rowscale and the Gluon kernel, at most VARIANTS_S = 180 s; then the
#     warp-specialised 128x256 Gluon kernel, at most WS_S = 50 s);
#   - then the FP8 loss curves (fp8_curves.py: bf16, e4m3 blockwise and tensorwise; at most CURVES_S = 170 s;
#     `fp8_curves.py --render` here makes the rows and the plot from fp8_curves.partial.jsonl if the limit ended it),
#     losses and no timing, so beside them, once TE imports: tests/gpu/test_te_gpu.py and the MLA layer's CUDA-graph
#     replay;
#   - then, alone on the GPU, TE's timings: the FP8 GEMM anchor (bench te_gemm) and the TE layers at t = 1
#     (bench layer, as te_checks.sh runs them), each skipped where it would end after DEADLINE_S (586; a shorter
#     call sets a smaller one and VARIANTS_S, the TE build waited for until DEADLINE_S - 270).
# Back in $OUT: res.tgz (every output and log: fp8_blockwise_variants.jsonl, fp8_curves.*, te_build.log,
# te_gpu.out, te_gemm.*, layer_te_t1.*), cards.txt, and the wheel parts of a fresh TE build.
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
# the warp-specialised kernel in a run of its own, after the others: a hang there costs only its own rows
timeout "${VARIANTS_S:-180}" python3 "$REPO/benchmarks/device/fp8_blockwise_variants.py" --out "$R" \
  --variants rowscale,gluon --tiles 64x128x128/3/4,64x128x128/4/4,128x128x128/4/8,128x128x128/6/8 2>&1 \
  | tee "$R/fp8_blockwise_variants.out" | grep -v -i warn | tail -24
timeout "${WS_S:-50}" python3 "$REPO/benchmarks/device/fp8_blockwise_variants.py" --out "$R" \
  --variants gluon-ws --tiles 128x256x128/4/4 --programs-per-sm 1 2>&1 \
  | tee -a "$R/fp8_blockwise_variants.out" | grep -v -i warn | tail -10
echo "variants done at ${SECONDS}s"
# the curves (losses, no timing) beside the Transformer Engine tests once the build is done; the timings after both
timeout "${CURVES_S:-170}" python3 "$REPO/benchmarks/device/fp8_curves.py" --out "$R" \
  --runs bf16,e4m3/blockwise,e4m3/tensorwise > "$R/fp8_curves.out" 2>&1 &
curves=$!
# the TE build waited for until 270 s (its steps' limits) before the deadline
timeout $(( SECONDS < DEADLINE_S - 270 ? DEADLINE_S - 270 - SECONDS : 1 )) tail --pid=$build -f /dev/null
tail -10 "$R/te_build.log"
W=$R
export PYTHONPATH=/tmp/te-site:$PYTHONPATH UB_SKIPMC=1
te_ok=0; python3 -c "import transformer_engine.pytorch" > /dev/null 2>&1 && te_ok=1
if (( ! te_ok )); then
  echo "Transformer Engine does not import at ${SECONDS}s (still building, or the build failed): its checks skipped"
else
  tests te_gpu 165 "$REPO/tests/gpu/test_te_gpu.py" \
    "$REPO/tests/gpu/test_mla_gpu.py::test_mla_layer_captured_replays_bit_for_bit_at_t2_on_one_gpu"
fi
wait $curves
grep -v -i warn "$R/fp8_curves.out" | tail -6
echo "curves done at ${SECONDS}s"
if (( te_ok )); then
  step te_gemm 100 python3 -m overlap_tp.bench te_gemm --out "$R" --jsonl "$R/te_gemm.jsonl"
  grep -E "^\S+ \| " "$R/te_gemm.out" | cut -c1-150 | head -30
  step layer_te 90 torchrun --nproc-per-node 1 -m overlap_tp.bench layer --models smoke --seq 2048 --micro-batch 2 \
    --graphs --configs megatron,te,te-ub,off,signal --reps 20 --rounds 2 --out "$R" --name layer_te_t1
  grep -E "config=|^- " "$R/layer_te.out" | cut -c1-200 | tail -12
fi
echo "ended at ${SECONDS}s"
