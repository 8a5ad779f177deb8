"""Loss curves of a small GPT on overlap_tp's layers, bf16 against FP8 (tensorwise and blockwise), at TP 2 as two
processes on one GPU over the p2p transport (the test harness of tests/gpu/peers_on_one_gpu.py: the ranks time-slice
the GPU, so the curves are what this measures, not speed).

On the device (one H100 or H200; about 3 minutes with the defaults):

    source benchmarks/device/setup.sh && python3 $REPO/benchmarks/device/fp8_curves.py --out $OUT

Model (every TP-split dimension a multiple of 128, as the blockwise recipe needs): --layers 2, hidden 512, FFN 1536
(SwiGLU), 8 heads / 4 query groups of 64, RMSNorm, RoPE, no biases, sequence 512, micro-batch 4, vocab 8192, on
get_gpt_layer_overlap_spec with every TP op 'signal' on p2p, between a replicated embedding and output layer
(TinyLM). Data: tests/gpu/test_gpt_parity_gpu.py's learnable batches (each token's successor
from a fixed random table over 1024 ids, 10% noise), the same for every run. Training: Adam (lr 1e-3, betas 0.9 /
0.95) on fp32 master copies, --steps 300, the same seed for every run, so the runs differ only in the linears' FP8.
Runs: bf16; e4m3 and hybrid with --fp8-recipe tensorwise; the same with blockwise (--runs to choose).

Writes $OUT/fp8_curves.partial.jsonl as each run ends (its losses; `--render` makes the rest from it), then
$OUT/fp8_curves.jsonl (one row per run: its losses, and its final loss, the mean of the last 20 steps, relative to
bf16's) and $OUT/fp8_curves.svg (the curves). The target: each FP8 run's final loss within 1% of bf16's.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNS = ("bf16", "e4m3/tensorwise", "hybrid/tensorwise", "e4m3/blockwise", "hybrid/blockwise")
SIZES = dict(layers=2, hidden=512, ffn=1536, heads=8, groups=4, seq=512, batch=4, vocab=8192, active_vocab=1024,
             lr=1e-3)
TAIL = 20   # the final loss: the mean of the last TAIL steps


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--layers", type=int, default=SIZES["layers"])
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    p.add_argument("--cpu", action="store_true", help="a smoke run on the CPU (gloo, the Triton interpreter, the "
                   "ops on their NCCL transport over gloo): the script's own check, not a measurement")
    p.add_argument("--render", metavar="PARTIAL", help="run nothing: write fp8_curves.jsonl and .svg into --out from "
                   "the runs a fp8_curves.partial.jsonl holds (a call whose time limit ended the script); --commit "
                   "and --cards name the measurement")
    p.add_argument("--commit", default=os.environ.get("OVERLAP_TP_GIT_COMMIT", "unknown"))
    p.add_argument("--cards", default="unknown")
    return p.parse_args(argv)


class TinyLM(torch.nn.Module):
    """overlap_tp's TransformerLayers (sequence parallel, TP 2) between a replicated embedding and a replicated
    output layer: each rank embeds the whole sequence, keeps its rows (the layers' sequence shard), and scores its
    own rows' next tokens. Replicated parameters (embedding, final norm, output) get their gradients all-reduced over
    TP with the sequence-parallel ones (the layers' norms), as Megatron's finalize_model_grads does; the TP-split
    linears get theirs through the ops. (Megatron's own GPTModel at TP 2 with SP reduce-scatters its embedding, which
    the gloo group of two ranks on one GPU cannot.)"""

    def __init__(self, run, sizes, device):
        super().__init__()
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from megatron.core.transformer.spec_utils import build_module
        from megatron.core.transformer.transformer_config import TransformerConfig
        from overlap_tp import OverlapConfig
        from overlap_tp.megatron.layer_spec import get_gpt_layer_overlap_spec
        from overlap_tp.megatron.settings import OverlapSettings
        fp8 = {} if run == "bf16" else dict(zip(("fp8", "fp8_recipe"), run.split("/")))
        config = TransformerConfig(
            num_layers=sizes["layers"], hidden_size=sizes["hidden"], ffn_hidden_size=sizes["ffn"],
            num_attention_heads=sizes["heads"], num_query_groups=sizes["groups"],
            kv_channels=sizes["hidden"] // sizes["heads"], normalization="RMSNorm", layernorm_epsilon=1e-5,
            gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
            hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
            apply_rope_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
            params_dtype=torch.bfloat16, bf16=True, init_method_std=0.02, tensor_model_parallel_size=2,
            sequence_parallel=True, use_cpu_initialization=device.type == "cpu", **fp8)
        torch.manual_seed(1234)
        if device.type == "cuda":
            model_parallel_cuda_manual_seed(1234)
        transport = "p2p" if device.type == "cuda" else "nccl"
        spec = get_gpt_layer_overlap_spec(settings=OverlapSettings().with_configs(
            OverlapConfig(method="signal", transport=transport, comm_sms=0)))
        self.layers = torch.nn.ModuleList(build_module(spec, config=config, layer_number=i + 1)
                                          for i in range(sizes["layers"]))
        self.embedding = torch.nn.Embedding(sizes["vocab"], sizes["hidden"], dtype=torch.bfloat16)
        self.norm = torch.nn.RMSNorm(sizes["hidden"], eps=1e-5, dtype=torch.bfloat16)
        self.output = torch.nn.Linear(sizes["hidden"], sizes["vocab"], bias=False, dtype=torch.bfloat16)
        for p in (self.embedding.weight, self.output.weight):
            torch.nn.init.normal_(p, std=0.02)
            p.replicated = True
        self.norm.weight.replicated = True
        dim = config.kv_channels   # RoPE as Megatron's RotaryEmbedding gives it: [s, 1, 1, dim] angles
        self.register_buffer("inv_freq", 1.0 / 500000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim),
                             persistent=False)
        self.to(device)

    def forward(self, tokens, labels, rank, world):
        """The mean loss of this rank's rows (tokens, labels [b, s]; the sequence split in world parts)."""
        s = tokens.shape[1]
        rows = slice(rank * s // world, (rank + 1) * s // world)
        x = self.embedding(tokens).transpose(0, 1)[rows].contiguous()   # [s/t, b, h]
        freqs = torch.outer(torch.arange(s, device=tokens.device, dtype=torch.float32), self.inv_freq)
        rope = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
        for layer in self.layers:
            x, _ = layer(hidden_states=x, attention_mask=None, rotary_pos_emb=rope)
        logits = self.output(self.norm(x)).float()   # [s/t, b, vocab]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 labels.transpose(0, 1)[rows].reshape(-1))


def _ranks(rank, world, args, queue):
    sys.path[:0] = [os.path.join(ROOT, "tests", "gpu"), os.path.join(ROOT, "tests")]
    import warnings
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    from overlap_tp.megatron.fp8_linear import keep_fp8_weights_per_step, new_fp8_step
    from test_gpt_parity_gpu import batch
    device = torch.device("cpu" if args.cpu else "cuda")
    if not args.cpu:
        from peers_on_one_gpu import install
        torch.cuda.set_device(0)
        install()
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    group = ps.get_tensor_model_parallel_group()
    sizes = dict(SIZES, layers=args.layers, **(dict(seq=64, batch=2, vocab=1024, active_vocab=256) if args.cpu
                                                else {}))
    for run in args.runs.split(","):
        model = TinyLM(run, sizes, device)
        keep_fp8_weights_per_step(model)
        params = [p for p in model.parameters() if p.requires_grad]
        masters = [p.detach().float().clone().requires_grad_(True) for p in params]
        optimizer = torch.optim.Adam(masters, lr=sizes["lr"], betas=(0.9, 0.95), eps=1e-8)
        losses, start = [], time.time()
        for step in range(args.steps):
            new_fp8_step(model)   # as the training hook does before each step
            for p in params:
                p.grad = None
            tokens, labels, _ = batch(sizes, step, device)
            local = model(tokens, labels, rank, world)
            (local / world).backward()   # the step's loss: the mean over the ranks' rows
            for p, master in zip(params, masters):
                grad = p.grad.float()
                if getattr(p, "sequence_parallel", False) or getattr(p, "replicated", False):
                    dist.all_reduce(grad, group=group)
                master.grad = grad
            loss = local.detach().clone()
            dist.all_reduce(loss, group=group)
            loss /= world
            optimizer.step()
            with torch.no_grad():
                for p, master in zip(params, masters):
                    p.copy_(master)
            losses.append(loss.item())
        if rank == 0:
            row = {"run": run, "losses": losses, "seconds": round(time.time() - start, 1)}
            queue.put(row)
            with open(os.path.join(args.out, "fp8_curves.partial.jsonl"), "a") as f:   # kept if a time limit ends it
                f.write(json.dumps(row) + "\n")
        del model, optimizer, masters, params
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ps.destroy_model_parallel()


def _svg(rows, path, width=720, height=420):
    """The loss curves as a small SVG (no plotting library needed)."""
    top = max(max(r["losses"]) for r in rows)
    low = min(min(r["losses"]) for r in rows)
    steps = max(len(r["losses"]) for r in rows)
    colors = ["#000000", "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#ff7f0e"]
    pad = 50

    def xy(i, v):
        return (pad + (width - 2 * pad) * i / max(steps - 1, 1),
                height - pad - (height - 2 * pad) * (v - low) / max(top - low, 1e-9))
    lines = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">',
             '<rect width="100%" height="100%" fill="white"/>',
             f'<text x="{pad}" y="20" font-size="14">lm loss per step (TP 2, one GPU, p2p)</text>',
             f'<text x="5" y="{pad}" font-size="11">{top:.2f}</text>',
             f'<text x="5" y="{height - pad}" font-size="11">{low:.2f}</text>',
             f'<text x="{width - pad}" y="{height - 20}" font-size="11">{steps} steps</text>']
    for k, row in enumerate(rows):
        points = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(i, v) for i, v in enumerate(row["losses"])))
        color = colors[k % len(colors)]
        lines.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.2" points="{points}"/>')
        lines.append(f'<text x="{width - 200}" y="{40 + 16 * k}" font-size="12" fill="{color}">{row["run"]}: '
                     f'{row["final"]:.4f}</text>')
    lines.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    args = parse_args(argv)
    if args.render:
        os.makedirs(args.out, exist_ok=True)
        with open(args.render) as f:
            write_results([json.loads(line) for line in f if line.strip()], args, args.cards)
        return
    sys.path[:0] = [os.path.join(ROOT, "tests")]
    import torch.multiprocessing as mp
    from distributed import run_distributed
    os.makedirs(args.out, exist_ok=True)
    if args.cpu:   # before any kernel module is imported: the ranks inherit it
        os.environ["TRITON_INTERPRET"] = "1"
    queue = mp.get_context("spawn").Manager().Queue()
    run_distributed(2, _ranks, args, queue, backend="gloo")
    rows = []
    while not queue.empty():
        rows.append(queue.get())
    write_results(rows, args, "cpu" if args.cpu else torch.cuda.get_device_name(0))


def write_results(rows, args, cards):
    """fp8_curves.jsonl (one row per run, its final loss and that over bf16's) and fp8_curves.svg, in --out."""
    order = args.runs.split(",")
    rows.sort(key=lambda r: order.index(r["run"]) if r["run"] in order else len(order))
    for row in rows:
        row["final"] = sum(row["losses"][-TAIL:]) / len(row["losses"][-TAIL:])
    base = next((r["final"] for r in rows if r["run"] == "bf16"), None)
    with open(os.path.join(args.out, "fp8_curves.jsonl"), "w") as f:
        for row in rows:
            row.update(final_vs_bf16=None if base is None else row["final"] / base, steps=len(row["losses"]),
                       layers=args.layers, commit=args.commit, cards=cards,
                       date=row.get("date") or time.strftime("%Y-%m-%d", time.gmtime()))
            f.write(json.dumps(row) + "\n")
            print(f"{row['run']:>18}: final {row['final']:.4f}"
                  + ("" if base is None else f" ({100 * (row['final'] / base - 1):+.2f}% of bf16)")
                  + f", first {row['losses'][0]:.3f}, {row['seconds']} s")
    _svg(rows, os.path.join(args.out, "fp8_curves.svg"))


if __name__ == "__main__":
    main()
