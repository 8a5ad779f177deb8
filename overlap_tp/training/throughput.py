"""Training throughput, MFU and overlap statistics, as plain functions plus a Megatron logging hook.

FLOPs: `gpt_flops_per_iteration` is Megatron's analytic count (`megatron.training.training.
num_floating_point_operations`, megatron-core 0.19) for a dense GPT, GQA and SwiGLU included:

    6 * B * s * [ L * (h * f * e  +  h * (q + 2 * kv)  +  q * h)  +  h * V ]   projections, MLP, logits
  + 6 * B * s^2 * L * q                                                      causal core attention

B global batch, s sequence length, L layers, h hidden, f FFN hidden, e = 3 with SwiGLU (2 without),
q = kv_channels * heads, kv = kv_channels * query groups, V padded vocabulary. The 6 is forward +
two backward GEMMs (3) times 2 FLOPs per multiply-add; the causal mask halves QK^T and PV, which
the two of them together double back.

MFU = achieved TFLOP/s/GPU / peak. `PEAK_BF16_DENSE_TFLOPS` = 989: NVIDIA's H100 SXM and H200 (SXM)
datasheets give 1,979 TFLOP/s BF16 Tensor Core *with 2:4 sparsity*, i.e. 989 dense. Override with
`peak_tflops=`, `--overlap-tp-peak-tflops` or the environment variable OVERLAP_TP_PEAK_TFLOPS.

Overlap statistics (`OverlapStats`, fed by overlap_tp.training.sampling with the synchronous overlapped op
calls of the step whose end is logged, on the logging rank). For each call c: op(c) its time on the GPU
(CUDA events around the call, on its stream), gemm(c) the GEMM alone and comm(c) the collective alone on
the same shapes (cuBLAS / torch.distributed, measured once per shape outside the step time). Then

    exposed_comm_ms = sum_c max(0, op(c) - gemm(c))        ms per logged step, >= 0: the time the overlapped
                                                           calls took beyond their GEMMs, i.e. the
                                                           communication (and what it costs the GEMM)
                                                           left on the critical path
    comm_hidden     = 1 - min(1, exposed / sum_c comm(c))  in [0, 1]: the share of the collectives'
                                                           own time that did not show up; GEMM then
                                                           collective (--overlap-tp off) ~ 0, full overlap 1

written in total and per op kind (overlap_tp/<kind>/exposed_comm_ms, .../comm_hidden), with op_ms,
gemm_ms and comm_ms (the sums) for context. They are left out, with the reason in the `[overlap_tp]`
line (`overlap stats: left out (...)`), where they would mean nothing: no op call ran eagerly in the
step (Megatron's own layers, CUDA graphs replaying the layers, whose Python does not run, or TP 1, where
no op call moves anything between ranks), or the
step was host-bound (in most sampled calls the GPU had already reached the call's start before the host
had finished issuing it, so the call's time includes the host's launch time, not only GPU work).

`install_training_log_hook()` wraps Megatron's `training_log` so that every `--log-interval` it
prints one `[overlap_tp]` line on the last rank and writes the same scalars through Megatron's
TensorBoard and W&B writers (`megatron.training.global_vars.get_tensorboard_writer/get_wandb_writer`).
"""
import functools
import math
import os
import time

from overlap_tp.ops import symmetric

PEAK_BF16_DENSE_TFLOPS = 989.0
PEAK_SOURCE = ("NVIDIA H100 SXM / H200 datasheets: BF16 Tensor Core 1,979 TFLOP/s with 2:4 sparsity, "
               "989 dense")
PEAK_ENV = "OVERLAP_TP_PEAK_TFLOPS"
SCALAR_PREFIX = "overlap_tp/"


def peak_tflops(override=None):
    """The per-GPU peak used for MFU: `override`, else $OVERLAP_TP_PEAK_TFLOPS, else 989 (H100/H200)."""
    if override:
        return float(override)
    if os.environ.get(PEAK_ENV):
        return float(os.environ[PEAK_ENV])
    return PEAK_BF16_DENSE_TFLOPS


def padded_vocab_size(vocab_size, tensor_parallel_size=1, divisible_by=128):
    """Megatron's vocabulary padding: up to a multiple of divisible_by * TP."""
    multiple = divisible_by * tensor_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def gpt_flops_per_iteration(*, num_layers, hidden_size, ffn_hidden_size, num_attention_heads, seq_length,
                            global_batch_size, vocab_size, num_query_groups=None, kv_channels=None,
                            swiglu=False):
    """FLOPs of one training iteration (forward + backward) of a dense GPT, as Megatron counts them.

    `vocab_size` is the padded vocabulary (Megatron's `args.padded_vocab_size`).
    """
    kv_channels = kv_channels or hidden_size // num_attention_heads
    groups = num_query_groups or num_attention_heads
    q = kv_channels * num_attention_heads
    kv = kv_channels * groups
    expansion = 3 if swiglu else 2
    tokens = global_batch_size * seq_length
    per_token = num_layers * (hidden_size * ffn_hidden_size * expansion
                              + hidden_size * (q + 2 * kv) + q * hidden_size) + hidden_size * vocab_size
    attention = global_batch_size * seq_length ** 2 * num_layers * q
    return 6 * tokens * per_token + 6 * attention


def flops_from_args(args, batch_size=None):
    """`gpt_flops_per_iteration` from Megatron's args (dense models; GQA only with --group-query-attention)."""
    heads = args.num_attention_heads
    gqa = getattr(args, "group_query_attention", False)
    vocab = getattr(args, "padded_vocab_size", None) or padded_vocab_size(
        args.vocab_size, getattr(args, "tensor_model_parallel_size", 1),
        getattr(args, "make_vocab_size_divisible_by", 128))
    return gpt_flops_per_iteration(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size, num_attention_heads=heads,
        num_query_groups=args.num_query_groups if gqa else heads,
        kv_channels=getattr(args, "kv_channels", None), seq_length=args.seq_length,
        global_batch_size=batch_size or args.global_batch_size, vocab_size=vocab,
        swiglu=getattr(args, "swiglu", False))


def megatron_flops(args, batch_size=None):
    """Megatron's own count where megatron.training is importable (MoE, MLA, ... too), else ours."""
    batch_size = batch_size or args.global_batch_size
    try:
        from megatron.training.training import num_floating_point_operations
        return num_floating_point_operations(args, batch_size)
    except (ImportError, AttributeError):  # no megatron.training, or `args` is not a full Megatron namespace
        return flops_from_args(args, batch_size)


def tokens_per_sec_per_gpu(global_batch_size, seq_length, step_time_s, world_size):
    return global_batch_size * seq_length / (step_time_s * world_size)


def tflops_per_gpu(flops_per_iteration, step_time_s, world_size):
    """Megatron's 'throughput per GPU (TFLOP/s/GPU)': all GPUs of the job share the iteration's FLOPs."""
    return flops_per_iteration / (step_time_s * 1e12 * world_size)


def mfu(tflops, peak=None):
    """Model FLOPs utilization, a fraction (0.45 = 45%)."""
    return tflops / peak_tflops(peak)


# ---- overlap statistics ------------------------------------------------------------------------

HOST_BOUND_SHARE = 0.5   # more sampled calls than this with the GPU waiting on the host: stats left out


def exposed_comm_ms(op_ms, gemm_ms):
    """Time an overlapped call took beyond its GEMM alone on the same shapes (ms, never negative)."""
    return max(0.0, op_ms - gemm_ms)


def comm_hidden(exposed_ms, comm_ms):
    """Share of the collectives' own time that did not show up, in [0, 1]; None without communication."""
    if comm_ms <= 0:
        return None
    return 1.0 - min(1.0, exposed_ms / comm_ms)


class OverlapStats:
    """The sampled op calls of one logged step.

    record(kind, op_ms, gemm_ms, comm_ms, gpu_waited=False): one call: its GPU time, its GEMM and its
    collective alone on the same shapes; gpu_waited: the GPU had reached the call before the host finished
    issuing it. leave_out(reason): the step's figures mean nothing (the reason is logged).
    summary(): {"left_out": reason}, or the totals (calls, op_ms, gemm_ms, comm_ms, exposed_comm_ms,
    comm_hidden) with "by_kind"; {} when nothing was recorded or left out.
    """

    def __init__(self):
        self.records = []
        self.reason = None

    def record(self, kind, op_ms, gemm_ms, comm_ms, gpu_waited=False):
        self.records.append((kind, float(op_ms), float(gemm_ms), float(comm_ms), bool(gpu_waited)))

    def leave_out(self, reason):
        self.reason = reason

    def summary(self):
        if self.reason is None and self.records:
            waited = sum(r[4] for r in self.records)
            if waited > HOST_BOUND_SHARE * len(self.records):
                self.reason = (f"host-bound: the GPU waited for the host in {waited} of {len(self.records)} "
                               "sampled calls, whose times then include launch time")
        if self.reason is not None:
            return {"left_out": self.reason}
        if not self.records:
            return {}
        out = _totals(self.records)
        kinds = dict.fromkeys(r[0] for r in self.records)
        out["by_kind"] = {kind: _totals([r for r in self.records if r[0] == kind]) for kind in kinds}
        return out

    def reset(self):
        self.records.clear()
        self.reason = None


def _totals(records):
    exposed = sum(exposed_comm_ms(r[1], r[2]) for r in records)
    comm = sum(r[3] for r in records)
    return {"calls": len(records), "op_ms": sum(r[1] for r in records), "gemm_ms": sum(r[2] for r in records),
            "comm_ms": comm, "exposed_comm_ms": exposed, "comm_hidden": comm_hidden(exposed, comm)}


OVERLAP_STATS = OverlapStats()


# ---- per-interval scalars and the Megatron hook ------------------------------------------------

OVERLAP_KEYS = ("exposed_comm_ms", "comm_hidden", "op_ms", "gemm_ms", "comm_ms")


def interval_scalars(*, step_time_s, global_batch_size, seq_length, world_size, flops_per_iteration,
                     peak=None, overlap=None):
    """The scalars of one log interval, keyed as they are written (prefix overlap_tp/)."""
    tflops = tflops_per_gpu(flops_per_iteration, step_time_s, world_size)
    scalars = {
        "step_time_ms": step_time_s * 1e3,
        "tokens_per_sec_per_gpu": tokens_per_sec_per_gpu(global_batch_size, seq_length, step_time_s, world_size),
        "tflops_per_gpu": tflops,
        "mfu": mfu(tflops, peak),
    }
    for key in OVERLAP_KEYS:
        if overlap and overlap.get(key) is not None:
            scalars[key] = overlap[key]
    for kind, totals in (overlap or {}).get("by_kind", {}).items():
        for key in OVERLAP_KEYS:
            if totals.get(key) is not None:
                scalars[f"{kind}/{key}"] = totals[key]
    return {SCALAR_PREFIX + k: v for k, v in scalars.items()}


def format_line(iteration, scalars, left_out=None):
    """The stdout line `overlap_tp.training.report` parses; `left_out`: why the overlap figures are missing."""
    s = {k[len(SCALAR_PREFIX):]: v for k, v in scalars.items()}
    parts = [f"[overlap_tp] iteration {iteration:8d}",
             f"step time (ms): {s['step_time_ms']:.1f}",
             f"tokens/s/GPU: {s['tokens_per_sec_per_gpu']:.1f}",
             f"TFLOP/s/GPU: {s['tflops_per_gpu']:.1f}",
             f"MFU: {100 * s['mfu']:.2f}%"]
    if "exposed_comm_ms" in s:
        parts.append(f"exposed comm (ms/step): {s['exposed_comm_ms']:.3f}")
    if "comm_hidden" in s:
        parts.append(f"comm hidden: {s['comm_hidden']:.3f}")
    if left_out:
        parts.append(f"overlap stats: left out ({left_out})")
    return " | ".join(parts) + " |"


def write_scalars(scalars, iteration, tensorboard_writer=None, wandb_writer=None):
    if tensorboard_writer is not None:
        for key, value in scalars.items():
            tensorboard_writer.add_scalar(key, value, iteration)
    if wandb_writer is not None:
        wandb_writer.log(dict(scalars), iteration)


class ThroughputLogger:
    """Per-interval throughput from wall-clock stamps taken right after Megatron's `training_log`.

    Megatron's training_log synchronizes (timers with barrier) on the iterations it prints, so the
    stamps bracket whole iterations. Evaluation inside an interval counts as training time here
    (recipes keep evaluation out of measured runs). With a `sampler` (overlap_tp.training.sampling.OpSampler),
    every logged iteration first turns the sampled ops' stamps into `stats` records; the interval's
    stamp is taken after that, so reference measurements of new shapes stay out of the step time.
    """

    def __init__(self, args, *, peak=None, clock=time.perf_counter, stats=OVERLAP_STATS, sampler=None,
                 printer=print):
        self.args = args
        self.peak = peak if peak is not None else getattr(args, "overlap_tp_peak_tflops", None)
        self.clock = clock
        self.stats = stats
        self.sampler = sampler if stats is not None else None
        self.printer = printer
        self.last = None  # (iteration, time)
        self.flops = None
        self.history = []

    def on_log(self, iteration, tensorboard_writer=None, wandb_writer=None, is_last_rank=True):
        now = self.clock()
        interval = getattr(self.args, "log_interval", 1) or 1
        logged = iteration % interval == 0 or iteration == getattr(self.args, "train_iters", None)
        if self.last is not None and not logged:
            return None
        after = now
        if self.sampler is not None:   # on every rank: it may run collectives
            stepped = self.sampler.was_armed
            if self.sampler.collect(self.stats) == 0 and stepped:
                self.stats.leave_out(no_samples_reason(self.args))
            after = self.clock()
        if self.last is None or iteration <= self.last[0]:
            self.last = (iteration, after)
            if self.stats is not None:
                self.stats.reset()
            return None
        step_time = (now - self.last[1]) / (iteration - self.last[0])
        self.last = (iteration, after)
        if self.flops is None:
            self.flops = megatron_flops(self.args)
        overlap = self.stats.summary() if self.stats is not None else None
        scalars = interval_scalars(
            step_time_s=step_time, global_batch_size=self.args.global_batch_size,
            seq_length=self.args.seq_length, world_size=getattr(self.args, "world_size", 1),
            flops_per_iteration=self.flops, peak=self.peak, overlap=overlap)
        if self.stats is not None:
            self.stats.reset()
        self.history.append((iteration, scalars))
        if is_last_rank:
            self.printer(format_line(iteration, scalars, left_out=(overlap or {}).get("left_out")))
            write_scalars(scalars, iteration, tensorboard_writer, wandb_writer)
            memory = symmetric.summary() if len(self.history) == 1 else ""   # the plans are built by now
            if memory:
                self.printer(f"[overlap_tp] symmetric memory on this GPU, not in torch's or Megatron's memory "
                             f"report: {memory}")
        return scalars


def no_samples_reason(args):
    """Why a sampled step saw no overlapped op call (the layers' Python did not run them)."""
    impl = getattr(args, "cuda_graph_impl", None)
    if impl not in (None, "none") or getattr(args, "enable_cuda_graph", False) or getattr(args, "external_cuda_graph", False):
        flag = f"--cuda-graph-impl {impl}" if impl not in (None, "none") else "CUDA graphs"
        return f"{flag}: graph replays run the layers without their Python, so no op call can be timed"
    if getattr(args, "overlap_tp", "off") == "off" and not getattr(args, "overlap_tp_layers", False):
        return "Megatron's own layers (--overlap-tp off): no overlap_tp op to time"
    if getattr(args, "tensor_model_parallel_size", 2) == 1:
        return "TP 1: the layers' ops move nothing between ranks, so there is no communication to time"
    return "no overlapped op call ran in the sampled step"


def stats_enabled(args) -> bool:
    """Overlap statistics are sampled unless --no-overlap-tp-stats."""
    return getattr(args, "overlap_tp_stats", True)


def install_training_log_hook(args=None, module=None):
    """Wrap `megatron.training.training.training_log` (once) to run a ThroughputLogger after it, and
    `train_step` (once) to arm overlap_tp.training.sampling.SAMPLER for the step whose end is logged (attached to
    that step's model: Megatron's train_step(forward_step_func, data_iterator, model, ...)).

    `module` defaults to `megatron.training.training`; tests pass a stand-in. Returns the logger
    (None until the first log when `args` is None: it reads Megatron's args then).
    """
    from overlap_tp.training.sampling import SAMPLER, sample_iteration
    if module is None:
        from megatron.training import training as module

    def run_args():
        return args if args is not None else _megatron_args()

    def new_logger():
        a = run_args()
        return ThroughputLogger(a, sampler=SAMPLER if stats_enabled(a) else None)

    original_step = getattr(module, "train_step", None)
    if original_step is not None and not getattr(original_step, "_overlap_tp_sampling", False):
        @functools.wraps(original_step)
        def train_step(*a, **kw):
            current = run_args()
            iteration = kw.get("iteration", getattr(current, "curr_iteration", None))
            SAMPLER.armed = stats_enabled(current) and sample_iteration(iteration, current.log_interval)
            if SAMPLER.armed:
                SAMPLER.attach(kw["model"] if "model" in kw else a[2])
            try:
                return original_step(*a, **kw)
            finally:
                SAMPLER.armed = False

        train_step._overlap_tp_sampling = True
        module.train_step = train_step

    original = module.training_log
    if getattr(original, "_overlap_tp_logger", None) is not None:
        return original._overlap_tp_logger
    state = {"logger": None}

    @functools.wraps(original)
    def training_log(*a, **kw):
        result = original(*a, **kw)
        iteration = kw["iteration"] if "iteration" in kw else a[3]
        logger = state["logger"]
        if logger is None:
            logger = state["logger"] = training_log._overlap_tp_logger = new_logger()
        tb, wb = _writers()
        logger.on_log(iteration, tb, wb, is_last_rank=_is_last_rank())
        return result

    training_log._overlap_tp_logger = None
    if args is not None:
        state["logger"] = training_log._overlap_tp_logger = new_logger()
    module.training_log = training_log
    return state["logger"]


def _megatron_args():
    from megatron.training import get_args
    return get_args()


def _writers():
    try:
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
    except ImportError:
        return None, None
    return get_tensorboard_writer(), get_wandb_writer()


def _is_last_rank():
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == dist.get_world_size() - 1
    except ImportError:
        pass
    return True
