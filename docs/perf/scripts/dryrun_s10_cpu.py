# CPU dry run of run_s10_megatron_lm.sh (no GPU): the checkout's pretrain_gpt.py with the script's flags, through
# overlap-tp-run (signal, off) and with --spec alone, up to Megatron's pretrain(), which is replaced by a check of the
# model config's layer spec and the layers' OverlapConfig. Megatron's GPU checks in validate_args are stubbed.
# Run from the repository root with megatron-core 0.19 installed: python docs/perf/scripts/dryrun_s10_cpu.py signal|off|spec
import os, sys, re
os.environ.update(CUDA_DEVICE_MAX_CONNECTIONS="1", WORLD_SIZE="2", RANK="0", LOCAL_RANK="0")
MLM = os.path.abspath(".megatron-lm")
sys.path.insert(0, MLM)
from megatron.training import arguments, training
arguments.get_device_arch_version = lambda: 9
import megatron.training.training as T
def fake_pretrain(cfg, *a, **k):
    from megatron.training import get_args
    args = get_args()
    spec = cfg.model.transformer_layer_spec if hasattr(cfg, "model") else None
    print("DRY spec:", args.spec, type(spec).__name__ if spec is not None else None)
    from megatron.core.transformer import transformer_block
    transformer_block.get_num_layers_to_build = lambda config, vp_stage=None, pp_rank=None: config.num_layers
    from overlap_tp.megatron_patches import spec as S
    from overlap_tp.megatron import layers
    if spec is not None:
        block = spec(cfg.model, vp_stage=None) if callable(spec) else spec
        print("DRY layers:", len(block.layer_specs), block.layer_specs[0].module.__name__, block.layer_norm.__name__)
    print("DRY gemm_rs config:", layers.get_default_overlap_config("gemm_rs"))
    sys.exit(0)
T.pretrain = fake_pretrain
import megatron.training as MT; MT.pretrain = fake_pretrain
text = open("docs/perf/scripts/run_s10_megatron_lm.sh").read()
flags = re.search(r"ARGS=\((.*?)\)\n", text, re.S).group(1).split()
mode = sys.argv[1]
if mode == "spec":
    sys.argv = [MLM + "/pretrain_gpt.py"] + flags + ["--spec", "overlap_tp.megatron_patches.spec", "signal"]
    import runpy
    try:
        runpy.run_path(MLM + "/pretrain_gpt.py", run_name="__main__")
    except SystemExit as e:
        print("exit", e.code)
else:
    from overlap_tp.launch import run as R
    extra = ["--overlap-tp", "signal"] if mode == "signal" else ["--overlap-tp", "off", "--overlap-tp-layers"]
    try:
        R.run(MLM + "/pretrain_gpt.py", flags + extra)
    except SystemExit as e:
        print("exit", e.code)
