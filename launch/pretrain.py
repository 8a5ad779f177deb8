"""`overlap-tp-pretrain` / `python -m overlap_tp.launch.pretrain`: Megatron GPT pretraining with overlap_tp.

Run it under torchrun with Megatron's usual flags plus overlap_tp's (`--overlap-tp signal ...`, see
`overlap_tp.megatron.arguments`). It is Megatron's own flow, `megatron.training.pretrain`: Megatron parses
and validates the arguments (with overlap_tp's group added), `validate_overlap_args` and
`megatron_patches.apply` switch the layer spec, and the GPT model, forward step, loss and datasets are
the ones of Megatron-LM's `pretrain_gpt.py`, kept minimal (that script is not part of the
megatron-core wheel). Data: Megatron's mock GPT dataset unless `--data-path` (or the per-split
paths) are given. Throughput, MFU and overlap scalars go to stdout, TensorBoard and W&B through
`overlap_tp.training.throughput`. Where megatron-core runs torch's AdamW (no Apex or Transformer Engine), each
parameter keeps its own Adam step after a distributed-optimizer checkpoint load (`separate_adam_steps`: a
megatron-core bug that makes resumed runs drift).

`overlap-tp-pretrain --check ARGS` only parses and validates ARGS (Megatron's checks and overlap_tp's) on the CPU
and prints `ok` or the error (launch/check.py); in a run, an error in overlap_tp's flags is one line on rank 0,
status 2.

Needs `megatron.training`: megatron-core >= 0.19 on Python >= 3.12, or a Megatron-LM checkout on
PYTHONPATH. For Megatron-LM's own scripts (pretrain_gpt.py ...) use `overlap-tp-run` (launch/run.py). Written against megatron-core 0.19 (`pretrain(cfg_container, ...)`); older
`pretrain(...)` signatures get a model provider instead of the model config.
"""
import dataclasses
import inspect
import os
import sys
from functools import partial

from overlap_tp.launch.orphans import end_with_spawning_rank

# a process this rank spawns through multiprocessing (torch_dist checkpointing's Manager) imports this module
# first: it ends when the rank does (launch/orphans.py)
end_with_spawning_rank()

PROG = "overlap-tp-pretrain"
DEFAULTS = {"tokenizer_type": "NullTokenizer"}   # Megatron's args_defaults: mock data needs no tokenizer files
HOW_TO_GET_MEGATRON = (
    "megatron.training is not importable here ({error}). It ships with megatron-core >= 0.19, which "
    "needs Python >= 3.12: `pip install -e \".[megatron]\"`. Or put a Megatron-LM checkout on "
    "PYTHONPATH: `PYTHONPATH=/path/to/Megatron-LM overlap-tp-pretrain ...`. "
    "`python -m overlap_tp.launch.env_check` prints the versions found.")


def require_megatron_training():
    try:
        import megatron.training  # noqa: F401
        import megatron.training.training  # noqa: F401
    except ImportError as error:  # also megatron-core >= 0.17 on Python < 3.12 (typing.override)
        raise SystemExit(f"{PROG}: " + HOW_TO_GET_MEGATRON.format(error=error))


def preflight(local_ranks, argv=None):
    """What a training launch needs, before torchrun starts anything (recipes/common.sh): one CUDA GPU per local
    rank (counted before Megatron is imported, whose import warns at length on a machine without GPUs), then
    megatron.training, then, given the launch's arguments `argv`, `--check`'s parse and validation of them. Prints
    one line and returns 1 (the machine) or 2 (the arguments) where something is wrong, else 0."""
    try:
        require_gpus(local_ranks)
        require_megatron_training()
    except SystemExit as error:
        print(error, file=sys.stderr)
        return 1
    if argv is None:
        return 0
    from overlap_tp.launch.check import check
    return check(PROG, argv, defaults=DEFAULTS, quiet=True)


def require_gpus(local_ranks):
    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < local_ranks:
        raise SystemExit(f"{PROG}: {local_ranks} rank(s) per node need as many CUDA GPUs; "
                         f"{count} visible here")


# ---- data --------------------------------------------------------------------------------------

def _on_data_stage(vp_stage=None):
    from megatron.core import mpu
    return mpu.is_pipeline_first_stage(ignore_virtual=True) or mpu.is_pipeline_last_stage(ignore_virtual=True)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's GPT datasets (mock unless a data path is given). Built on every tensor-parallel rank
    of the first and last pipeline stages (`is_distributed`), so no TP broadcast of the batch is needed:
    all TP ranks of a data-parallel rank read the same samples."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer, print_rank_0
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    values = {"random_seed": args.seed, "sequence_length": args.seq_length, "blend": blend,
              "blend_per_split": blend_per_split, "tokenizer": get_tokenizer(),
              "path_to_cache": getattr(args, "data_cache_path", None),
              "create_attention_mask": getattr(args, "create_attention_mask_in_dataloader", False),
              "sequence_parallel_size": args.tensor_model_parallel_size * bool(args.sequence_parallel)}
    for name in ("split", "num_dataset_builder_threads", "mmap_bin_files", "reset_position_ids",
                 "reset_attention_mask", "eod_mask_loss", "object_storage_cache_path",
                 "mid_level_dataset_surplus", "allow_ambiguous_pad_tokens", "context_parallel_size",
                 "data_parallel_size"):
        if hasattr(args, name):
            values[name] = getattr(args, name)
    accepted = {f.name for f in dataclasses.fields(GPTDatasetConfig) if f.init}
    config = GPTDatasetConfig(**{k: v for k, v in values.items() if k in accepted})
    mock = getattr(args, "mock_data", False) or (blend is None and not any(blend_per_split or []))
    print_rank_0(f"> building {'mock ' if mock else ''}GPT datasets ...")
    return BlendedMegatronDatasetBuilder(MockGPTDataset if mock else GPTDataset, train_val_test_num_samples,
                                         partial(_on_data_stage, vp_stage), config).build()


train_valid_test_datasets_provider.is_distributed = True


# ---- forward step ------------------------------------------------------------------------------

def get_batch(data_iterator):
    """tokens, labels, loss_mask, attention_mask, position_ids on this GPU (None on middle stages)."""
    from megatron.core import mpu
    if data_iterator is None:
        return None, None, None, None, None
    batch = next(data_iterator)
    batch = {k: (v.cuda(non_blocking=True) if hasattr(v, "cuda") else v) for k, v in batch.items()}
    if mpu.get_context_parallel_world_size() > 1:
        from megatron.core.utils import get_batch_on_this_cp_rank
        parameters = inspect.signature(get_batch_on_this_cp_rank).parameters
        extra = {"is_hybrid_cp": False} if "is_hybrid_cp" in parameters else {}
        extra.update({"cp_group": mpu.get_context_parallel_group()} if "cp_group" in parameters else {})
        batch = get_batch_on_this_cp_rank(batch, **extra)
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"),
            batch["position_ids"])


def loss_func(loss_mask, output_tensor):
    """Sum of the masked per-token losses, the token count, and Megatron's 'lm loss' report."""
    import torch
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    from megatron.training import get_timers
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


# ---- model (only for megatron.training without GPTModelConfig, i.e. < 0.19) -------------------

def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                         get_gpt_layer_with_transformer_engine_spec)
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args
    from overlap_tp.megatron_patches.apply import SPEC, overlap_layer_spec

    args = get_args()
    config = config or core_transformer_config_from_args(args)
    if list(args.spec or []) == list(SPEC):
        spec = overlap_layer_spec(config, vp_stage=vp_stage)
    elif args.transformer_impl == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(args.num_experts, args.moe_grouped_gemm,
                                                          args.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                        normalization=args.normalization)
    kwargs = {"vp_stage": vp_stage, "pg_collection": pg_collection}
    accepted = inspect.signature(GPTModel.__init__).parameters
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
        post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, **{k: v for k, v in kwargs.items() if k in accepted and v is not None})


# ---- main --------------------------------------------------------------------------------------

def _has_data_source(args):
    return bool(getattr(args, "data_path", None) or getattr(args, "data_args_path", None)
                or getattr(args, "per_split_data_args_path", None)
                or any(getattr(args, n, None) for n in ("train_data_path", "valid_data_path", "test_data_path")))


def extra_args_provider(parser):
    from overlap_tp.launch.run import repair_help_strings
    from overlap_tp.megatron.arguments import add_overlap_args
    return repair_help_strings(add_overlap_args(parser))


def use_prebuilt_dataset_helpers():
    """Megatron's initialization runs `make` in megatron/core/datasets to build the C++ dataset helpers.
    A pip-installed megatron-core ships them prebuilt (helpers_cpp) and has no Makefile, so that make
    fails and ends the run. Where the prebuilt module imports and no Makefile exists, skip the build
    (idempotent; says so once)."""
    import importlib
    import os

    from megatron.core.datasets import utils as dataset_utils
    if getattr(dataset_utils.compile_helpers, "overlap_tp_prebuilt", False):
        return
    folder = os.path.dirname(dataset_utils.__file__)
    if os.path.exists(os.path.join(folder, "Makefile")):
        return
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return

    def compile_helpers():
        print("> overlap_tp: megatron-core's dataset helpers are prebuilt (helpers_cpp); not compiling", flush=True)

    compile_helpers.overlap_tp_prebuilt = True
    dataset_utils.compile_helpers = compile_helpers


def separate_adam_steps():
    """After a distributed-optimizer checkpoint load, give every parameter its own Adam `step` tensor (a named,
    idempotent patch of megatron-core's DistributedOptimizer.load_state_dict; only where megatron-core runs torch's
    AdamW, i.e. without Apex or Transformer Engine). Returns whether it patched now.

    Why: megatron-core (0.16 to 0.19) restores torch AdamW's per-parameter `step` from the checkpoint's param groups
    as ONE tensor put into every parameter's state, and AdamW adds 1 to each parameter's step in place, so after a
    resume the shared step advances once per parameter per update: from the first update on, every parameter but the
    first is bias-corrected for another step count than in the uninterrupted run (a resumed run equal at its first
    iteration, off from its second). The recipes
    with `--use-distributed-optimizer` (llama3-8b, llama3-70b-proxy, mixtral-proxy) take this path, the smoke recipe
    (Megatron's non-distributed optimizer, which restores the step per parameter) does not. The patch leaves the
    restored values as they are and only stops the sharing."""
    import torch
    try:
        from megatron.core.optimizer import distrib_optimizer
    except ImportError:
        return False
    optimizer_class = distrib_optimizer.DistributedOptimizer
    load = optimizer_class.load_state_dict
    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True) or getattr(load, "overlap_tp_separate_steps", False):
        return False

    def load_state_dict(self, state_dict):
        result = load(self, state_dict)
        seen = set()
        for state in self.optimizer.state.values():   # torch AdamW's state per parameter
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    state["step"] = step.clone()
                seen.add(id(state["step"]))
        return result

    load_state_dict.overlap_tp_separate_steps = True
    load_state_dict.__doc__ = load.__doc__
    optimizer_class.load_state_dict = load_state_dict
    print("> overlap_tp: megatron-core runs torch's AdamW here (no Apex / Transformer Engine): each parameter's "
          "Adam step is its own tensor after a checkpoint load (launch/pretrain.py separate_adam_steps)", flush=True)
    return True


def main(argv=None):
    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    if "--check" in sys.argv[1:]:   # Megatron's and overlap_tp's validation only, on the CPU (launch/check.py)
        from overlap_tp.launch.check import check
        return check(PROG, [a for a in sys.argv[1:] if a != "--check"], defaults=DEFAULTS)
    if not any(flag in sys.argv[1:] for flag in ("-h", "--help")):
        require_gpus(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    require_megatron_training()
    from overlap_tp.megatron.arguments import OverlapArgumentError
    try:
        return _main()
    except OverlapArgumentError as error:   # once, on rank 0, no traceback (every rank stops alike)
        from overlap_tp.launch.check import refuse
        return refuse(PROG, error)


def _main():
    use_prebuilt_dataset_helpers()
    separate_adam_steps()

    from megatron.core.enums import ModelType
    from megatron.training import arguments as megatron_arguments
    from megatron.training import print_rank_0, training

    from overlap_tp.megatron.validation import validate_overlap_args
    from overlap_tp.megatron_patches.apply import apply
    from overlap_tp.training.fp8_steps import install_fp8_weight_steps
    from overlap_tp.training.throughput import install_training_log_hook

    defaults = dict(DEFAULTS)
    if hasattr(megatron_arguments, "parse_and_validate_args"):  # >= 0.18
        args = megatron_arguments.parse_and_validate_args(extra_args_provider=extra_args_provider,
                                                          args_defaults=defaults)
    else:  # 0.17: pretrain() parses; apply() runs from the model provider (it is idempotent)
        return _pretrain_legacy(training, ModelType, defaults)

    validate_overlap_args(args)
    apply(args)
    if not _has_data_source(args) and not getattr(args, "mock_data", False):
        args.mock_data = True
        print_rank_0("> no --data-path: training on Megatron's mock GPT dataset")
    install_training_log_hook()
    install_fp8_weight_steps()

    parameters = inspect.signature(training.pretrain).parameters
    kwargs = {"train_valid_test_dataset_provider": train_valid_test_datasets_provider,
              "model_type": ModelType.encoder_or_decoder, "forward_step_func": forward_step}
    if "cfg_container" in parameters:
        from megatron.training import argument_utils
        model_cfg = None
        if hasattr(argument_utils, "gpt_config_from_args"):  # >= 0.19: the builder reads args.spec
            model_cfg = argument_utils.gpt_config_from_args(args)
        else:
            kwargs["model_provider"] = model_provider
        kwargs["cfg_container"] = argument_utils.pretrain_cfg_container_from_args(args, model_cfg)
    else:
        kwargs["model_provider"] = model_provider
    training.pretrain(**kwargs)
    release_full_iteration_graphs()
    return 0


def release_full_iteration_graphs():
    """Free Megatron's full-iteration CUDA graphs once training is done, before the interpreter exits.

    They sit in a class attribute (FullCudaGraphWrapper.cuda_graph), so without this they are destroyed in
    the interpreter's last teardown, next to the NCCL communicators they captured collectives of, and a run under
    `--cuda-graph-impl full_iteration` logs its last iteration and then never exits (overlap off and on alike;
    under `--cuda-graph-impl local` the graphs live on the modules and the run exits). Megatron-Bridge frees its
    graphs before the process group for the same reason
    (its _delete_cuda_graphs). The process group itself is left to Megatron, as its own pretrain_gpt.py does."""
    try:
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    except ImportError:
        return
    if not any(graph is not None for graph in FullCudaGraphWrapper.cuda_graph.values()):
        return
    import gc
    import torch
    torch.cuda.synchronize()   # no replay may still run on the graphs being freed
    for stage in FullCudaGraphWrapper.cuda_graph:
        FullCudaGraphWrapper.cuda_graph[stage] = None
        FullCudaGraphWrapper.result[stage] = None   # outputs in the graphs' memory pool
    gc.collect()


def _pretrain_legacy(training, ModelType, defaults):
    from megatron.training import get_args
    from overlap_tp.megatron.validation import validate_overlap_args
    from overlap_tp.megatron_patches.apply import apply
    from overlap_tp.training.fp8_steps import install_fp8_weight_steps
    from overlap_tp.training.throughput import install_training_log_hook

    def provider(*args, **kwargs):
        megatron_args = get_args()
        validate_overlap_args(megatron_args)
        apply(megatron_args)
        return model_provider(*args, **kwargs)

    install_training_log_hook()
    install_fp8_weight_steps()
    training.pretrain(train_valid_test_datasets_provider, provider, ModelType.encoder_or_decoder, forward_step,
                      extra_args_provider=extra_args_provider, args_defaults=defaults)
    release_full_iteration_graphs()
    return 0


if __name__ == "__main__":
    sys.exit(main())
