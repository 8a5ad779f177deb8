# The next session's third call (2 GPUs; ~8 min), written in session 25: issue 25's one unmet MoE figure, the Zipf
# routing at the cross-node proxy (s22: 1.13x of Megatron's MoELayer against the 1.15x target; uniform 1.17x). The
# expert ops' groups and comm SMs swept there (bench moe_layer's new .gN / .smN variants; `signal` is the launchers'
# groups=2, comm_sms=4), new routing every step, both routings, interleaved rounds. If one beats `signal` on Zipf
# without losing on uniform, it becomes EXPERT_OP_DEFAULTS (and the tuner's candidates).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=540
workdir s26_3
export CUDA_VISIBLE_DEVICES=0,1
step moe_sweep 300 env NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m overlap_tp.bench moe_layer --tokens 8192 \
  --routings 8 --routing zipf,uniform --methods signal,signal.g3,signal.g4,signal.sm8,signal.g4.sm8,off \
  --out $W --name moe_layer_proxy_sweep
grep -E "^\| |^- " $W/moe_layer_proxy_sweep.md | cut -c1-400 | head -8
# Issue 25's ops figure at the proxy (median % of ideal >= 50%), not measured since session 13 (before the expert ops'
# changes): a2a_gemm and gemm_a2a against sequential, with the groups x comm_sms sweep.
step moe_ops_proxy 200 env NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m overlap_tp.bench moe --tokens 8192 \
  --routing uniform,zipf --sweep --out $W --name moe_ops_proxy
grep -E "^\| |^- " $W/moe_ops_proxy.md | cut -c1-300 | head -12
