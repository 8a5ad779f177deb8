#!/usr/bin/env bash
# Transformer Engine on one GPU (docs/te.md), from the repository root, carrying .te (te_pack.py's output, with the
# kept PyTorch extension in .te/torch-ext/ once a build returned it):
#   COMMIT=<sha> bash benchmarks/device/te_checks.sh
# Installs TE with te_build.sh unless it already imports from $TE_SITE (default /tmp/te-site), then, each a step
# under its time limit (setup.sh; DEADLINE_S skips a step that would end later):
#   te_gpu     pytest -m gpu tests/gpu/test_te_gpu.py: our spec with TE's attention and norms at t = 2 against
#              Megatron's TE layer at t = 1; --tp-comm-overlap with --overlap-tp an error; the smoke recipe's first
#              steps at TP 1 on Megatron's TE layers
#   mla_te     pytest -m gpu tests/gpu/test_mla_gpu.py -k captured: the MLA layer captured and replayed bit for bit
#              at t = 2 (with TE its down projections are TELinear, which a graph can capture; without TE it skips)
#   te_gemm    python -m overlap_tp.bench te_gemm: the FP8 GEMM anchor (te.Linear under Float8CurrentScaling and
#              Float8BlockScaling, torch._scaled_mm, bf16) on the l8b / l70b forward GEMMs at t = 2, s 8192:
#              $OUT/te_gemm.{json,md} and $OUT/te_gemm.jsonl (results.jsonl's fields)
#   layer_te   bench layer at t = 1 (one rank), smoke layer, CUDA graphs: megatron, te, te-ub, off, signal
#              (te-ub at t = 1: userbuffers initialised, no linear on them: TE overlaps only with sequence
#              parallelism): $OUT/layer_te_t1.{json,md}
# Logs: $OUT/te_checks.tgz. Results come back in $OUT; the TE build, when this call made it, in $OUT as
# transformer_engine_torch-*.whl.part-* (copy them to .te/torch-ext/ here to skip the build next time).
source "$(dirname "$0")/setup.sh"
TE_SITE=${TE_SITE:-/tmp/te-site}
export OUT   # te_build.sh returns a fresh build of the PyTorch extension there
export TE_SITE UB_SKIPMC=${UB_SKIPMC:-1}
export PYTHONPATH=$TE_SITE${PYTHONPATH:+:$PYTHONPATH}
if ! python3 -c "import transformer_engine.pytorch" > /dev/null 2>&1; then
  t0=$SECONDS
  (cd "$REPO" && bash benchmarks/device/te_build.sh) 2>&1 | tail -12
  echo "te_build.sh took $((SECONDS - t0)) s"
fi
python3 -c "import transformer_engine as te, transformer_engine.pytorch; print('transformer_engine', te.__version__)" \
  || { echo "Transformer Engine does not import: nothing to check"; exit 1; }
workdir te_checks
tests te_gpu 180 "$REPO/tests/gpu/test_te_gpu.py"
tests mla_te 120 "$REPO/tests/gpu/test_mla_gpu.py" -k captured
step te_gemm 100 python3 -m overlap_tp.bench te_gemm --out "$OUT" --jsonl "$OUT/te_gemm.jsonl"
grep -E "^\S+ \| " "$W/te_gemm.out" | cut -c1-150 | head -40
step layer_te 90 torchrun --nproc-per-node 1 -m overlap_tp.bench layer --models smoke --seq 2048 --micro-batch 2 \
  --graphs --configs megatron,te,te-ub,off,signal --reps 20 --rounds 2 --out "$OUT" --name layer_te_t1
grep -E "config=|^- " "$W/layer_te.out" | cut -c1-200 | tail -12
