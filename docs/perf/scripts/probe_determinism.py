# Session 13: what makes two identical layer runs differ on one GPU (TP 1)?
#   REPO=$PWD torchrun --nproc-per-node 1 docs/perf/scripts/probe_determinism.py
# (1) each SDPA backend's backward twice on the same inputs, with and without
# torch.use_deterministic_algorithms; (2) the overlap layer twice with off / p2p configs, default and under
# each remedy.
import os, sys, contextlib, torch, torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
sys.path.insert(0, os.path.join(os.environ["REPO"], "tests")); sys.path.insert(0, os.path.join(os.environ["REPO"], "tests", "gpu"))
torch.cuda.set_device(0)

def sdpa_twice(backend, det):
    torch.use_deterministic_algorithms(det, warn_only=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, do = (torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    grads = []
    for _ in range(3):
        qi, ki, vi = (t.clone().requires_grad_(True) for t in (q, k, v))
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True)
        out.backward(do)
        grads.append((out, qi.grad, ki.grad, vi.grad))
    same = [all(torch.equal(a, b) for a, b in zip(grads[0], r)) for r in grads[1:]]
    torch.use_deterministic_algorithms(False)
    return same

for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
    for det in (False, True):
        try:
            print(f"sdpa {backend.name} deterministic_algorithms={det}: runs 2,3 equal to run 1: {sdpa_twice(backend, det)}", flush=True)
        except Exception as e:
            print(f"sdpa {backend.name} deterministic_algorithms={det}: {type(e).__name__}: {str(e)[:120]}", flush=True)

dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
import test_layers_gpu as T
from overlap_tp import OverlapConfig
from overlap_tp.megatron.layer_spec import get_gpt_layer_overlap_spec
from overlap_tp.megatron.layers import set_overlap_config
from megatron.core.transformer.spec_utils import build_module
ps = T._setup(1, "cuda")
config, p2p = T._sp_p2p_config(1, num_layers=1)
off = {k: OverlapConfig(method="off") for k in ("ag_gemm", "gemm_rs", "gemm_ar")}
remedies = {"none": contextlib.nullcontext, "math": lambda: sdpa_kernel([SDPBackend.MATH])}
for label, cfgs in (("off", off), ("p2p", p2p)):
    for remedy in ("none", "det_algos", "math"):
        torch.use_deterministic_algorithms(remedy == "det_algos", warn_only=True)
        results = []
        for rep in range(3):
            T._seed(78, "cuda")
            layer = build_module(get_gpt_layer_overlap_spec(), config=config, layer_number=1).cuda()
            set_overlap_config(layer, cfgs)
            gen = torch.Generator(device="cuda").manual_seed(6)
            x = torch.randn(4096, 1, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
            g = torch.randn(4096, 1, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
            xi = x.clone().requires_grad_(True)
            with remedies.get(remedy, contextlib.nullcontext)():
                out, _ = layer(hidden_states=xi, attention_mask=None)
                out.backward(g)
            names = ["out", "dx"] + [n for n, _ in layer.named_parameters()]
            results.append([out, xi.grad] + [p.grad for _, p in layer.named_parameters()])
        for r in (1, 2):
            diff = [f"{names[i]} (max {float((a.float() - b.float()).abs().max()):.2e})"
                    for i, (a, b) in enumerate(zip(results[0], results[r])) if not torch.equal(a, b)]
            print(f"layer {label} remedy={remedy}: run {r + 1} vs run 1 differ: {diff or 'none'}", flush=True)
torch.use_deterministic_algorithms(False)
dist.destroy_process_group()
