# The next 2-GPU session's call 2 (nvidia-h200-x2), written at the end of session 13, extended in session 14 (one
# GPU only, which ran none of it): the smoke recipe at 0.945x of overlap off in session 13 (1.030x in session 11).
# - the smoke's layer at TP 2 under graphs, with a profile of one replay per configuration (session 14: at TP 1 our
#   layer computes 1.026x Megatron's; what the overlap adds or hides at TP 2 is the open question), since 92e5988
#   with the narrow tile on the smoke's proj / fc2 dgrad; and the smoke's four ops under graphs against
#   sequential (does the overlap's fixed latency exceed what it hides at 4-8 MB per transfer?);
# - the smoke end to end, one round of: off, signal, signal with --no-overlap-tp-fused-norms (Megatron's
#   TransformerLayer around our linears), full-iteration graphs, each watched for a hang at exit (a second round:
#   `ROUND=2 ONLY_TRAIN=1 bash docs/perf/scripts/run_s15_b.sh`);
# - last, if time is left: the GPU tests that session 13's review reshaped after its device time (one fwd/bwd helper
#   in the bitwise layer tests, one watchdog-exit helper in the graph tests, the pre-MLP norm's handover).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
ROUND=${ROUND:-1}
workdir s15_b${ONLY_TRAIN:+_round$ROUND}
if [[ -z ${ONLY_TRAIN:-} ]]; then
step layer_smoke 120 torchrun --nproc-per-node 2 -m overlap_tp.bench layer --graphs --models smoke --seq 2048 \
  --micro-batch 2 --configs megatron,nocomm,off,signal-p2p --reps 60 --rounds 8 --profile $W/prof --out $W --name layer_smoke
grep -E "^\| smoke" $W/layer_smoke.md
for f in $W/prof/*graph_rank0.json.gz; do python3 $REPO/docs/perf/scripts/trace_summary.py --steps 3 $f | head -30; done \
  > $W/layer_smoke_trace.txt 2>&1
step ops_smoke 80 torchrun --nproc-per-node 2 -m overlap_tp.bench ops --graphs --ops rs,ag --shapes smoke.proj,smoke.fc2 \
  --ag-shapes smoke.qkv,smoke.fc1 --seq 4096 --ag-seq 4096 --reps 40 --out $W --name ops_smoke
grep -E "^\| " $W/ops_smoke.md | head -8
fi
train smoke-off-$ROUND 75 GRAPHS=full_iteration OVERLAP=off TRAIN_ITERS=50 -- $REPO/recipes/smoke.sh
train smoke-signal-$ROUND 75 GRAPHS=full_iteration OVERLAP=signal TRAIN_ITERS=50 -- $REPO/recipes/smoke.sh
train smoke-unfused-$ROUND 75 GRAPHS=full_iteration OVERLAP=signal TRAIN_ITERS=50 -- $REPO/recipes/smoke.sh \
  --no-overlap-tp-fused-norms
python3 $REPO/docs/perf/scripts/summarize_runs.py $W/smoke-*/train.log | tee $W/smoke_ab.md
if [[ -z ${ONLY_TRAIN:-} ]]; then   # last: what the time left allows (the step is skipped, not cut, past the deadline)
step gpu_tests 160 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_layers_gpu.py $REPO/tests/gpu/test_graphs_gpu.py \
  -k "p2p_sum or mlp_boundary or never" -p no:cacheprovider
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $W/gpu_tests.out | tail -8
fi
