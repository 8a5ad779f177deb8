# Session 18, call 5 (ONE GPU): the column-parallel dgrads' p2p sums left to the norms' backward kernels: the compiled
# dy_slots path bitwise against the slot sum at training sizes (t = 1), the layer tests at TP 1, then the TP 2 layer
# checks on one GPU (two processes over CUDA IPC: deferred proj sum + deferred dgrad sums against the summed path,
# the MLP boundary, the layer captured fwd + bwd).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= OVERLAP_TP_WATCHDOG_S=120
workdir s18_five
step norm_gpu 150 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_fused_add_rmsnorm_gpu.py $REPO/tests/gpu/test_layers_gpu.py \
  -p no:cacheprovider
grep -E "passed|failed|FAILED|Error" $W/norm_gpu.out | tail -6
step p2p_layers 330 python3 -m pytest -m gpu -q -rA $REPO/tests/gpu/test_p2p_one_gpu.py -p no:cacheprovider \
  -k "check_deferred_proj_sum or check_mlp_boundary or layer_captured or norm_sums_the_slots or gather_rows"
grep -E "PASSED|FAILED|passed|failed|Error" $W/p2p_layers.out | head -12
