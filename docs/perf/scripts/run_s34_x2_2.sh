# Session 34, call 2 (2 GPUs, `nvidia-h200-x2`; ~5 min): `COMMIT=<sha> bash docs/perf/scripts/run_s34_x2_2.sh`
# (carry [".whl"]). Where the smoke's ops lose their time at t = 2 (s28 and call 1: every collective ~37 us, longer
# than its GEMM, 11-35 us; ours 0.034 / 0.045 ms on the ReduceScatters, 0.053-0.068 on the AllGathers, where the pulls
# alone should take ~20 us): one profiled graph replay of each variant, async-TP and the sequential path
# (probe_op_timeline.py), at the four smoke shapes (M 4096): rs proj (K 512, N 1024), rs fc2 (K 1408, N 1024),
# ag qkv (K 1024, N 768), ag fc1 (K 1024, N 2816).
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-590}
workdir s34_x2_2
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
P=$REPO/docs/perf/scripts/probe_op_timeline.py
AG=ours,g1,by-peer,cublas-by-peer,sm32,cublas-p2p
step tl_ag_qkv 120 torchrun --nproc-per-node 2 $P --op ag --shape 4096,1024,768 --variants $AG
step tl_ag_fc1 90 torchrun --nproc-per-node 2 $P --op ag --shape 4096,1024,2816 --variants $AG
step tl_rs_proj 90 torchrun --nproc-per-node 2 $P --op rs --shape 4096,512,1024
step tl_rs_fc2 90 torchrun --nproc-per-node 2 $P --op rs --shape 4096,1408,1024
for f in tl_ag_qkv tl_ag_fc1 tl_rs_proj tl_rs_fc2; do echo "=== $f"; grep -vE "^\[|Warning|warn" $W/$f.out | head -150; done
