# The next 2-GPU session's FIRST call (nvidia-h200-x2 or nvidia-h100-x2; ~9.5 min), written in session 19, which had
# no device time left (the same work's earlier try had spent it). Calls 2 and 3: run_s19_x2_2.sh, run_s19_x2_3.sh;
# then run_s15_moe.sh and run_s15_a.sh (MoE at EP 2 and the torch_dist fault), which a 30-minute budget will not
# reach in the same session. These three replace run_s18_x2.sh, run_s16_x2.sh, run_s15_b.sh and run_s15_e2e.sh
# (git has them): their steps are here, ordered by what the project needs to know first.
# Issue 21's gate: does the overlap make training faster, the baseline in the same graph mode? Nothing end to end has
# run since session 13 (smoke under full_iteration graphs 0.945x of off; llama3-8b 8 layers under local graphs 0.997x
# in session 11, before the fused blocks, the p2p transports as the default and the direct launches).
# - smoke (full_iteration, measured fastest for both sides in s10): off, signal (the default: p2p transports, the
#   fused blocks), and decompose over the p2p transports (session 19: cuBLAS GEMMs, no Triton GEMM; at the smoke's
#   shapes the signaled GEMM runs at 0.85x cuBLAS forward, docs/perf/s18, so this is where cuBLAS should help most);
# - llama3-8b, 8 layers (local graphs): off, signal, decompose-p2p.
# Predicted: smoke signal ~0.95x (nothing there changed what s13 saw: the GEMM deficit and 4-8 MB transfers),
# decompose-p2p >= signal; 8B signal 1.00-1.03x (the layer at 0.937 of Megatron's in s13, ~6% of it communication).
# Each run is watched for a hang at exit (train); a run that cannot finish before the deadline is skipped, not cut.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1
workdir s19_x2_1
train smoke-off 75 GRAPHS=full_iteration OVERLAP=off TRAIN_ITERS=50 -- $REPO/recipes/smoke.sh
train smoke-signal 75 GRAPHS=full_iteration OVERLAP=signal TRAIN_ITERS=50 -- $REPO/recipes/smoke.sh
train l8b8-off 110 GRAPHS=local OVERLAP=off TRAIN_ITERS=25 GBS=4 -- $REPO/recipes/llama3-8b.sh --num-layers 8
train l8b8-signal 110 GRAPHS=local OVERLAP=signal TRAIN_ITERS=25 GBS=4 -- $REPO/recipes/llama3-8b.sh --num-layers 8
train smoke-cublas 75 GRAPHS=full_iteration OVERLAP=decompose TRANSPORT=p2p TRAIN_ITERS=50 -- $REPO/recipes/smoke.sh
train l8b8-cublas 110 GRAPHS=local OVERLAP=decompose TRANSPORT=p2p TRAIN_ITERS=25 GBS=4 -- $REPO/recipes/llama3-8b.sh \
  --num-layers 8
python3 $REPO/docs/perf/scripts/summarize_runs.py $W/smoke-*/train.log | tee $W/smoke.md
python3 $REPO/docs/perf/scripts/summarize_runs.py --skip 8 $W/l8b8-*/train.log | tee $W/l8b8.md
grep -h -E "Error|error:|Traceback" $W/*/train.log | sort | uniq -c | head -8
