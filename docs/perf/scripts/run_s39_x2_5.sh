# Session 39, call 5 (2 GPUs, `nvidia-h200-x2`; ~4 min): `COMMIT=<sha> bash docs/perf/scripts/run_s39_x2_5.sh`
# (carry [".whl"]). After the review's split of P2PReduceScatter.finish into finish (a consuming kernel) and finish_sum
# (the signalling sum), and the call numbered as its sum launches: the paths through them, on GPUs.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_PROJECT= PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-400}
workdir s39_x2_5
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
tests gemm_rs 100 $REPO/tests/gpu/test_gemm_rs_gpu.py -k "gemm_rs and s8192 or async_op or 200_back_to_back"
tests layers 150 $REPO/tests/gpu/test_layers_gpu.py -k "p2p_sum_in_the_norm or token_split_matches and signal"
tests one_gpu 80 $REPO/tests/gpu/test_p2p_one_gpu.py -k "eager and not cublas and not layers"
