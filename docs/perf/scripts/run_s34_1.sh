# The next session's first call, written in session 33 (4 GPUs, `nvidia-h200-x4`; ~3 min, most of it compiling):
# `COMMIT=<sha> bash docs/perf/scripts/run_s34_1.sh` (carry [".whl"]). Session 33's call 4: on l8b.qkv at t = 4 under
# graphs ours 0.310 ms, async-TP 0.216, finer chunks slower (g8 0.372). One replay of each variant profiled: the
# timeline of the pulls against the GEMM (docs/perf/s33/README.md, "Why our AllGather+GEMM trails async-TP at t = 4").
# Session 33 had too little device time left to start it. The probe also runs OverlapConfig.chunk_by='peer' (built
# after session 33's calls, never yet on a GPU; it checks each variant's output against method 'off' first); its
# bit-for-bit GPU tests are the new cases in tests/gpu/test_ag_gemm_gpu.py and test_graphs_gpu.py.
source docs/perf/scripts/setup_device.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONFAULTHANDLER=1 DEADLINE_S=${DEADLINE_S:-200}
workdir s34_1
nvidia-smi --query-gpu=name --format=csv,noheader > $W/cards.txt
# session 34: the variants that answer the question, the SM pulls (handshakes inside their kernel) among them
step ag_timeline 170 torchrun --nproc-per-node 4 $REPO/docs/perf/scripts/probe_op_timeline.py --op ag --shape 8192,4096,1536 \
  --variants ours,g1,g2,sm16,sm32,narrow,narrow-763,by-peer,cublas-by-peer,lanes2
grep -E "^## " $W/ag_timeline.out
