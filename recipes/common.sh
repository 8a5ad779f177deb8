# Shared by the recipes (sourced, not run). A recipe sets RECIPE, MODEL_ARGS and TRAIN_ARGS, then
# calls run_recipe "$@". Environment knobs (all optional; recipes/README.md lists each recipe's defaults):
#   OVERLAP=auto|off|signal|decompose  --overlap-tp (default auto: everything else decided per op and per run;
#                                       off = the baseline); the MoE recipes pass the same to --overlap-moe
#   OVERLAP=te|te-ub                    the Transformer Engine baselines: Megatron's own TE layers (--transformer-impl
#                                       transformer_engine, --overlap-tp off), te-ub with --tp-comm-overlap (TE's
#                                       userbuffers, UB_SKIPMC=1: no NVLink multicast; TP >= 2); same model, batch and
#                                       graphs as the other modes (docs/te.md)
#   TUNE_CACHE=PATH                     with OVERLAP=auto: where the tuner keeps its decisions (exported as
#                                       OVERLAP_TP_TUNE_CACHE; default $OUT_DIR/overlap_tp_tune.json: a second run into
#                                       the same OUT_DIR tunes nothing)
#   Anything else of overlap_tp's (transports, SMs, the layer switches) goes in an expert config file given after the
#   recipe's name: --overlap-tp-config FILE (docs/config.md).
#   TP=2  NPROC=$TP (ranks per node)  NNODES=1  NODE_RANK=0  MASTER_ADDR=localhost  MASTER_PORT=29500 (static
#                                       rendezvous); NPROC x NNODES must be a multiple of TP
#   RDZV_ENDPOINT=host:port  RDZV_ID=job  torchrun's c10d rendezvous instead (multi-node, SLURM)
#   TRANSFORMER_IMPL=local|transformer_engine   (default: transformer_engine where it imports)
#   GRAPHS=local|full_iteration|none    Megatron's --cuda-graph-impl for both sides, on and off alike
#   WANDB_PROJECT (default overlap_tp; "" turns W&B off)  WANDB_MODE (offline unless set)  EXP_NAME
#   OUT_DIR (default runs/$RECIPE-$OVERLAP): train.log, tensorboard/, wandb/
#   LOG_INTERVAL (default 5)  PYTHON (default python3)  CUDA_DEVICE_MAX_CONNECTIONS (default 1)
#   DRY_RUN=1                           print the command that would run (one flag per line, quoted for the shell)
#   CHECK=1                             check the flags with Megatron's and overlap_tp's validation, on the CPU
# Arguments given to the recipe are appended to the Megatron command line (they win).

OVERLAP=${OVERLAP:-auto}
# overlap_tp's method: OVERLAP itself, or off for the Transformer Engine baselines
case $OVERLAP in te|te-ub) OVERLAP_METHOD=off ;; *) OVERLAP_METHOD=$OVERLAP ;; esac
TP=${TP:-2}
NPROC=${NPROC:-$TP}
PYTHON=${PYTHON:-python3}

_imports() { "$PYTHON" -c "import $1" >/dev/null 2>&1; }

# the learning-rate warmup: $1 iterations, at most the run's length $2 less one (Megatron asserts warmup < decay, and
# a few first steps, TRAIN_ITERS=3, are a run too)
warmup_iters() { if (( $1 < $2 )); then echo "$1"; else echo $(( $2 > 0 ? $2 - 1 : 0 )); fi; }

# TP, NPROC and NNODES are whole numbers and the job's ranks (NPROC x NNODES) a multiple of TP; else one line, 2
_check_layout() {
  local name
  for name in TP NPROC NNODES; do
    if [[ ! ${!name:-1} =~ ^[1-9][0-9]*$ ]]; then
      echo "[recipe] $name=${!name}: expected a positive whole number" >&2; return 2
    fi
  done
  if (( NPROC * ${NNODES:-1} % TP )); then
    echo "[recipe] NPROC=$NPROC x NNODES=${NNODES:-1} = $(( NPROC * ${NNODES:-1} )) ranks is not a multiple of TP=$TP:" \
         "set NPROC to a multiple of TP, or leave it unset (it follows TP)" >&2
    return 2
  fi
}

# _print_command ASSIGNMENTS... -- COMMAND...: `env ASSIGNMENTS` on one line, then the command with one flag and
# its values per line, every word quoted for the shell (pasted back, it runs the same command)
_print_command() {
  local line=env word
  while [[ $1 != -- ]]; do line+=" $(printf '%q' "$1")"; shift; done
  shift
  printf '%s \\\n' "$line"
  line=$(printf '%q' "$1")
  shift
  for word in "$@"; do
    if [[ $word == -* && ! $word =~ ^-[0-9.] ]]; then printf '%s \\\n' "$line"; line=" "; fi
    line+=" $(printf '%q' "$word")"
  done
  printf '%s\n' "$line"
}

# The MoE proxies' run: --overlap-moe with OVERLAP's method too; Megatron's grouped experts (TEGroupedMLP) where
# Transformer Engine imports (without it the baseline runs SequentialMLP; overlap_tp's experts are always one grouped
# GEMM per op); eager unless GRAPHS is given, since dropless routing sends the token counts to the host every step
# (GRAPHS=local then captures attention only: mixtral-proxy.sh says why).
run_moe_recipe() {
  local grouped=() graph_scope=()
  if _imports transformer_engine; then grouped=(--moe-grouped-gemm); fi
  GRAPHS=${GRAPHS:-none}
  if [[ $GRAPHS == local ]]; then graph_scope=(--cuda-graph-modules attn); fi
  run_recipe --overlap-moe "$OVERLAP_METHOD" "${grouped[@]}" "${graph_scope[@]}" "$@"
}

run_recipe() {
  _check_layout || return
  local fp8_args=() fp8_tag=""
  if [[ -n ${FP8:-} ]]; then   # FORMAT/RECIPE: Megatron's own FP8 flags (docs/fp8.md)
    if [[ ! $FP8 =~ ^(e4m3|hybrid)/(tensorwise|blockwise)$ ]]; then
      echo "[recipe] FP8=$FP8: expected FORMAT/RECIPE with FORMAT e4m3 or hybrid and RECIPE tensorwise or" \
           "blockwise (e.g. FP8=e4m3/tensorwise)" >&2
      return 2
    fi
    fp8_args=(--fp8-format "${FP8%/*}" --fp8-recipe "${FP8#*/}")
    fp8_tag=-fp8-${FP8%/*}-${FP8#*/}
  fi
  local out_dir=${OUT_DIR:-runs/$RECIPE-$OVERLAP$fp8_tag}
  local exp_name=${EXP_NAME:-$RECIPE-$OVERLAP$fp8_tag}
  local impl=${TRANSFORMER_IMPL:-}
  if [[ -z $impl ]]; then
    if _imports transformer_engine; then impl=transformer_engine; else impl=local; fi
  fi
  local te_args=() te_env=()
  if [[ $OVERLAP_METHOD != "$OVERLAP" ]]; then   # te, te-ub: Megatron's own Transformer Engine layers
    if ! _imports transformer_engine; then
      echo "[recipe] OVERLAP=$OVERLAP runs Megatron's Transformer Engine layers: transformer_engine does not import" \
           "here (docs/te.md: how to install it)" >&2
      return 2
    fi
    if [[ $impl != transformer_engine ]]; then
      echo "[recipe] OVERLAP=$OVERLAP runs Megatron's Transformer Engine layers: not with TRANSFORMER_IMPL=$impl" >&2
      return 2
    fi
    if [[ $OVERLAP == te-ub ]]; then
      if (( TP < 2 )); then
        echo "[recipe] OVERLAP=te-ub: --tp-comm-overlap needs TP >= 2 (Megatron runs it with sequence parallelism" \
             "only); OVERLAP=te runs Megatron's TE layers at TP=$TP" >&2
        return 2
      fi
      te_args=(--tp-comm-overlap)
      te_env=(UB_SKIPMC=1)   # userbuffers through CUDA IPC, not NVLink multicast
    fi
  fi
  local overlap_args=(--overlap-tp "$OVERLAP_METHOD")   # the one flag of ours: auto decides the rest
  local env_args=()
  if ! _imports transformer_engine && ! _imports fused_weight_gradient_mlp_cuda; then
    # Megatron's fused wgrad accumulation needs Apex or TE, its RoPE fusion TE.
    env_args+=(--no-gradient-accumulation-fusion --no-rope-fusion)
    if [[ $OVERLAP_METHOD == off ]] && ! _imports apex; then
      # Megatron's local spec has no sequence-parallel norm without TE or Apex (WrappedTorchNorm
      # refuses SP): run the baseline on overlap_tp's modules with the overlap off (cuBLAS, then the
      # collective, on one stream).
      echo "[recipe] neither Transformer Engine nor Apex: baseline runs overlap_tp's layers with --overlap-tp off" >&2
      overlap_args+=(--overlap-tp-layers)
    fi
  fi
  if [[ $impl == local ]] && ! _imports apex; then
    # Megatron's persistent LayerNorm and fused masked softmax are Apex's kernels, and on by default: without Apex
    # its local spec's torch norm refuses the first and its attention fails to import the second (seen at TP 1,
    # where Megatron's own layers run: nothing to communicate)
    env_args+=(--no-persist-layer-norm --no-masked-softmax-fusion)
  fi
  local graph_args=()
  case ${GRAPHS:-local} in
    none) ;;
    local) graph_args=(--cuda-graph-impl local) ;;
    full_iteration) graph_args=(--cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad) ;;
    *) echo "[recipe] GRAPHS=${GRAPHS}: expected local, full_iteration or none" >&2; return 2 ;;
  esac
  # the run's environment: NVLink multicast off, and what Megatron's sequence parallelism asks for
  local run_env=(NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
                 "CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}" "${te_env[@]}")
  if [[ $OVERLAP_METHOD == auto ]]; then
    # the tuner's decisions kept with the run (keyed by device and software versions), so that running the recipe
    # again into the same OUT_DIR measures nothing before its first step; without it they would go to --save, which
    # the recipes do not set
    run_env+=("OVERLAP_TP_TUNE_CACHE=${TUNE_CACHE:-$out_dir/overlap_tp_tune.json}")
  fi
  local log_args=(--log-interval "${LOG_INTERVAL:-5}" --log-throughput --log-timers-to-tensorboard
                  --tensorboard-dir "$out_dir/tensorboard" --eval-iters 0 --eval-interval 1000000)
  local project=${WANDB_PROJECT-overlap_tp}
  if [[ -n $project ]]; then
    if _imports wandb; then
      run_env+=("WANDB_MODE=${WANDB_MODE:-offline}")
      log_args+=(--wandb-project "$project" --wandb-exp-name "$exp_name" --wandb-save-dir "$out_dir/wandb")
    else
      echo "[recipe] W&B off: wandb is not installed (pip install -e \".[wandb]\"; WANDB_PROJECT= hides this line)" >&2
    fi
  fi
  local rendezvous=(--node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:-localhost}"
                    --master-port "${MASTER_PORT:-29500}")
  if [[ -n ${RDZV_ENDPOINT:-} ]]; then  # multi-node: torchrun's c10d rendezvous (launch/slurm_template.sh)
    rendezvous=(--rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${RDZV_ID:-overlap_tp}")
  fi
  local args=(--tensor-model-parallel-size "$TP" --sequence-parallel --transformer-impl "$impl"
              "${MODEL_ARGS[@]}" "${fp8_args[@]}" "${TRAIN_ARGS[@]}" "${log_args[@]}" "${overlap_args[@]}" "${te_args[@]}"
              "${env_args[@]}" "${graph_args[@]}" "$@")
  local cmd=(torchrun --nproc-per-node "$NPROC" --nnodes "${NNODES:-1}" "${rendezvous[@]}"
             -m overlap_tp.launch.pretrain "${args[@]}")
  # the launch's arguments as Megatron and overlap_tp validate them, for the whole job's ranks (launch/check.py)
  local check_env=("${run_env[@]}" "WORLD_SIZE=$(( NPROC * ${NNODES:-1} ))")
  [[ ${DRY_RUN:-0} == 1 ]] && _print_command "${run_env[@]}" -- "${cmd[@]}"
  if [[ ${CHECK:-0} == 1 ]]; then
    env "${check_env[@]}" "$PYTHON" -m overlap_tp.launch.pretrain --check "${args[@]}"
    return
  fi
  [[ ${DRY_RUN:-0} == 1 ]] && return 0
  # a GPU per rank, megatron.training, then the flags, before torchrun starts anything: one line, exit 1 or 2
  env "${check_env[@]}" "$PYTHON" -c \
    "import sys; from overlap_tp.launch.pretrain import preflight; sys.exit(preflight($NPROC, sys.argv[1:]))" \
    "${args[@]}" || return
  mkdir -p "$out_dir"
  echo "[recipe] $RECIPE, --overlap-tp $OVERLAP, graphs ${GRAPHS:-local}, log: $out_dir/train.log" >&2
  set -o pipefail
  env "${run_env[@]}" "${cmd[@]}" 2>&1 | tee "$out_dir/train.log"
}

# Llama-style model flags shared by the Llama recipes: RMSNorm, SwiGLU, GQA, no biases, RoPE, bf16.
LLAMA_ARGS=(--normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
            --group-query-attention --position-embedding-type rope --untie-embeddings-and-output-weights
            --attention-dropout 0.0 --hidden-dropout 0.0 --bf16 --attention-softmax-in-fp32
            --tokenizer-type NullTokenizer)
