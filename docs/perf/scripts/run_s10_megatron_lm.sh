# Session 10 (nvidia-h200-x2): Megatron-LM's own pretrain_gpt.py (tag core_v0.19.0) at the smoke shapes,
# TP 2 + SP, through overlap-tp-run with --overlap-tp signal and off, then once with
# --spec overlap_tp.megatron_patches.spec signal and no launcher. Logs under $OUT; about 3-4 minutes.
#
# Expects, carried from the repository root (never committed):
#   .megatron-lm/  the scripts and the megatron package of Megatron-LM at core_v0.19.0:
#                  G=$(fetch github:NVIDIA/Megatron-LM); mkdir .megatron-lm
#                  git --git-dir=$G archive core_v0.19.0 $(git --git-dir=$G ls-tree --name-only core_v0.19.0 \
#                      | grep -E '\.py$|^LICENSE$|^megatron$') | tar -x -C .megatron-lm     (11 MB; tests/ left out)
#   .whl/          megatron-core 0.19.2 (setup_device.sh installs it into /tmp/site); only its prebuilt
#                  dataset helpers are used here: the checkout's own megatron package runs, as it does
#                  for `python pretrain_gpt.py` (the script's folder comes first on sys.path).
# Run: COMMIT=<sha> bash docs/perf/scripts/run_s10_megatron_lm.sh
set -uo pipefail
MLM=$PWD/.megatron-lm
[[ -f $MLM/pretrain_gpt.py ]] || { echo "no Megatron-LM checkout at $MLM (see the header)"; exit 1; }
source docs/perf/scripts/setup_device.sh   # multicast off, wheels into /tmp/site, overlap_tp installed, cd /tmp
export CUDA_DEVICE_MAX_CONNECTIONS=1 OVERLAP_TP_GIT_COMMIT=${COMMIT:-unknown}

# Megatron-LM builds its C++ dataset helpers with make at start (pybind11 needed). The 0.19.2 wheel ships
# them prebuilt from the same helpers.cpp as the tag: put that build next to the checkout's source, newer
# than it, so make finds nothing to do (or build it where pybind11 is there).
DATASETS=$MLM/megatron/core/datasets
if python3 -m pybind11 --includes >/dev/null 2>&1 && command -v g++ >/dev/null && command -v make >/dev/null; then
  make -C "$DATASETS" 2>&1 | tail -2
else
  cp /tmp/site/megatron/core/datasets/helpers_cpp*.so "$DATASETS"/ && touch "$DATASETS"/helpers_cpp*.so
  echo "dataset helpers: the wheel's prebuilt build copied to $DATASETS"
  if ! command -v make >/dev/null; then   # Megatron-LM runs make; with the build in place there is nothing to do
    mkdir -p /tmp/bin && printf '#!/bin/sh\nexit 0\n' > /tmp/bin/make && chmod +x /tmp/bin/make && export PATH=/tmp/bin:$PATH
    echo "no make here: a no-op make on PATH (the helpers are prebuilt)"
  fi
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'GPUs', torch.cuda.device_count())"

# recipes/smoke.sh's model and training flags (recipes/common.sh's LLAMA_ARGS), 30 iterations, mock data,
# no TE / Apex here: local spec, no fused wgrad accumulation or RoPE fusion.
ARGS=(--tensor-model-parallel-size 2 --sequence-parallel --transformer-impl local
      --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear --group-query-attention
      --position-embedding-type rope --untie-embeddings-and-output-weights --attention-dropout 0.0
      --hidden-dropout 0.0 --bf16 --attention-softmax-in-fp32 --tokenizer-type NullTokenizer
      --num-layers 4 --hidden-size 1024 --ffn-hidden-size 2816 --num-attention-heads 16 --num-query-groups 4
      --kv-channels 64 --seq-length 2048 --max-position-embeddings 2048 --vocab-size 32000 --rotary-base 10000
      --micro-batch-size 2 --global-batch-size 8 --train-iters 30 --lr 3e-4 --min-lr 3e-5
      --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.1 --clip-grad 1.0 --init-method-std 0.02
      --seed 1234 --mock-data --log-interval 5 --log-throughput --eval-iters 0 --eval-interval 1000000
      --no-gradient-accumulation-fusion --no-rope-fusion)
TORCHRUN=(torchrun --nproc-per-node 2 --master-port 29511)

run() {   # name, then the command after torchrun's flags
  local name=$1; shift
  echo "== $name: $*" | tee "$OUT/$name.train.log"
  timeout 120 "${TORCHRUN[@]}" "$@" >> "$OUT/$name.train.log" 2>&1
  echo "== $name: exit $?" | tee -a "$OUT/$name.train.log"
  grep -E "^\[overlap_tp\]|iteration +30/|Error|error:" "$OUT/$name.train.log" | tail -6
}

# 1) overlap-tp-run, overlap on; 2) off: overlap_tp's layers with the overlap off (cuBLAS, then the collective),
# the recipes' baseline where neither TE nor Apex gives Megatron's local spec a sequence-parallel norm
run mlm-signal -m overlap_tp.launch.run "$MLM/pretrain_gpt.py" "${ARGS[@]}" --overlap-tp signal
run mlm-off -m overlap_tp.launch.run "$MLM/pretrain_gpt.py" "${ARGS[@]}" --overlap-tp off --overlap-tp-layers
# 3) Megatron-LM's script alone, overlap_tp's layers named by --spec (no launcher: no [overlap_tp] line)
run mlm-spec-signal "$MLM/pretrain_gpt.py" "${ARGS[@]}" --spec overlap_tp.megatron_patches.spec signal

python3 -m overlap_tp.training.report "$OUT/mlm-off.train.log=off (overlap-tp-run)" \
    "$OUT/mlm-signal.train.log=signal (overlap-tp-run)" "$OUT/mlm-spec-signal.train.log=signal (--spec)" \
    --out "$OUT/report" 2>&1 | tail -5
