# Session 15, call 4 (nvidia-h200, ONE GPU): `bench moe_layer` with the variants interleaved in rounds (the per-round
# range of each ratio reported), at EP 1, with auto; and probe_expert_host.py in its any-EP form (run at EP 2 by
# run_s15_moe.sh), checked here at EP 1.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT=
workdir s15_four
[[ -n $SKIP_HOST ]] || step host 120 torchrun --nproc-per-node 1 $REPO/docs/perf/scripts/probe_expert_host.py
[[ -n $SKIP_HOST ]] || grep -E "forward|_dispatch_state|dispatch_plan|_ExpertState|SignaledGemm" $W/host.out
step moe_layer 300 torchrun --nproc-per-node 1 -m overlap_tp.bench moe_layer --experts 4 --tokens 8192 --routings 8 \
  --routing zipf,uniform --methods signal,off,auto --reps 48 --rounds 6 --out $W --name moe_layer_ep1_rounds
grep -E "^\| " $W/moe_layer_ep1_rounds.md
