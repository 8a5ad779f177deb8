# Session 39, call 3 (2 GPUs, `nvidia-h200-x2`; ~9 min): `COMMIT=<sha> bash docs/perf/scripts/run_s39_x2_3.sh`
# (carry [".whl", ".ab"]; .ab/old: session 38's tree, as for run_s39_x2_1.sh).
# 1. The layer checks over the changed paths: the deferred sums (summed by the signalling sum, or consumed by the
#    fused add + RMSNorm), the MLP boundary, gathering in place, the token split (session 38's review commit, not yet
#    run on GPUs), the fused blocks at the 8B shape; the same layers on one GPU over CUDA IPC.
# 2. GPU time: `bench ops --graphs` GEMM+RS at t = 2 (p2p by default), session 38's tree against this one: the sum's
#    done counter and SUMMED stores (one atomic per CTA) should cost nothing measurable.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s39_x2_3
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
tests layers 210 $REPO/tests/gpu/test_layers_gpu.py -k "p2p_sum_in_the_norm or mlp_boundary_next or norms_write or token_split"
tests fused 100 $REPO/tests/gpu/test_layers_gpu.py -k "fused_blocks_at and l8b"
for tree in new old; do
  env=(); [[ $tree == old ]] && env=(PYTHONPATH=/tmp/old:/tmp/site) && \
    { rm -rf /tmp/old && python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/old $REPO/.ab/old 2>&1 | tail -1; }
  step ops_rs_$tree 75 env "${env[@]}" torchrun --nproc-per-node 2 -m overlap_tp.bench ops --graphs --ops rs \
    --shapes l8b.proj,l8b.fc2,l70b.proj --seq 8192 --reps 30 --out $W --name ops_rs_$tree
  grep -E "^\| rs " $W/ops_rs_$tree.md | cut -c1-200
done
tests layers_one_gpu 110 $REPO/tests/gpu/test_p2p_one_gpu.py -k "transformer_layers"
