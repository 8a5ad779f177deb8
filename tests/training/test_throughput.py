"""FLOPs (Megatron's analytic count), tokens/s/GPU, TFLOP/s/GPU, MFU and overlap statistics against
hand-worked numbers; the logging hook with a stand-in for Megatron's training module."""
import sys
from types import SimpleNamespace

import pytest
import torch

from overlap_tp.training import throughput as tp
from overlap_tp.training.report import parse_log


def test_small_config_by_hand():
    # L=2, h=64, f=256 (SwiGLU: e=3), 4 heads of 16 (q=64), 2 KV groups (kv=32), V=128, s=32, B=2.
    # per token: L*(h*f*e + h*(q+2kv) + q*h) + h*V = 2*(49152 + 8192 + 4096) + 8192 = 131072
    # linear: 6 * (B*s=64) * 131072 = 50_331_648; attention: 6 * B*s^2*L*q = 6 * 262_144 = 1_572_864
    flops = tp.gpt_flops_per_iteration(num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
                                       num_query_groups=2, kv_channels=16, seq_length=32, global_batch_size=2,
                                       vocab_size=128, swiglu=True)
    assert flops == 50_331_648 + 1_572_864 == 51_904_512


def test_no_swiglu_no_gqa():
    # e=2, kv=q=64: per token 2*(64*256*2 + 64*192 + 4096) + 8192 = 2*49152 + 8192 = 106496
    flops = tp.gpt_flops_per_iteration(num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
                                       seq_length=32, global_batch_size=2, vocab_size=128)
    assert flops == 6 * 64 * 106_496 + 1_572_864


def llama3_8b_args(**overrides):
    values = dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                  group_query_attention=True, num_query_groups=8, kv_channels=128, seq_length=8192,
                  global_batch_size=8, vocab_size=128256, padded_vocab_size=None, tensor_model_parallel_size=2,
                  make_vocab_size_divisible_by=128, swiglu=True, world_size=2, log_interval=5, train_iters=50)
    values.update(overrides)
    return SimpleNamespace(**values)


def test_llama3_8b():
    # per token: 32*(4096*14336*3 + 4096*(4096+2048) + 4096*4096) + 4096*128256
    #          = 32*218_103_808 + 525_336_576 = 7_504_658_432
    # one 8192-token sequence: 6*8192*7_504_658_432 + 6*8192^2*32*4096 = 368_868_971_249_664 + 52_776_558_133_248
    per_sequence = 421_645_529_382_912
    args = llama3_8b_args()
    assert tp.padded_vocab_size(128256, 2) == 128256
    assert tp.flops_from_args(args, batch_size=1) == per_sequence
    # global batch 8: the number megatron-core 0.19.2's num_floating_point_operations gives for the recipe
    assert tp.flops_from_args(args) == 8 * per_sequence == 3_373_164_235_063_296


def test_rates_and_mfu_for_llama3_8b():
    flops = tp.flops_from_args(llama3_8b_args())
    # 8 x 8192 tokens in 2.0 s over 2 GPUs
    assert tp.tokens_per_sec_per_gpu(8, 8192, 2.0, 2) == 16384.0
    tflops = tp.tflops_per_gpu(flops, 2.0, 2)
    assert tflops == pytest.approx(843.291058765824)
    assert tp.mfu(tflops) == pytest.approx(843.291058765824 / 989.0)
    assert tp.mfu(400.0, peak=800.0) == 0.5


def test_peak_override(monkeypatch):
    monkeypatch.delenv(tp.PEAK_ENV, raising=False)
    assert tp.peak_tflops() == 989.0 == tp.PEAK_BF16_DENSE_TFLOPS
    monkeypatch.setenv(tp.PEAK_ENV, "500")
    assert tp.peak_tflops() == 500.0
    assert tp.peak_tflops(700) == 700.0


def test_exposed_comm_and_comm_hidden_definitions():
    # a call of 0.9 ms whose GEMM alone takes 0.8 ms: 0.1 ms exposed; a call faster than its GEMM alone
    # (measurement noise) exposes nothing rather than a negative time
    assert tp.exposed_comm_ms(0.9, 0.8) == pytest.approx(0.1)
    assert tp.exposed_comm_ms(0.7, 0.8) == 0.0
    # of a 0.3 ms collective, 0.1 ms showed: two thirds hidden; GEMM then collective: nothing hidden; more
    # exposed than the collective alone (the GEMM slowed down by the overlap): 0, never negative
    assert tp.comm_hidden(0.1, 0.3) == pytest.approx(2 / 3)
    assert tp.comm_hidden(0.3, 0.3) == 0.0
    assert tp.comm_hidden(0.5, 0.3) == 0.0
    assert tp.comm_hidden(0.0, 0.3) == 1.0
    assert tp.comm_hidden(0.0, 0.0) is None


@pytest.mark.parametrize("op_ms, gemm_ms, comm_ms", [
    (0.1, 5.0, 0.3), (9.0, 0.1, 0.3), (1.0, 1.0, 1e-9), (0.0, 0.0, 0.0), (2.0, 1.0, 50.0)])
def test_figures_stay_in_range_by_construction(op_ms, gemm_ms, comm_ms):
    stats = tp.OverlapStats()
    stats.record("gemm_rs", op_ms, gemm_ms, comm_ms)
    s = stats.summary()
    assert s["exposed_comm_ms"] >= 0
    assert s["comm_hidden"] is None if comm_ms == 0 else 0.0 <= s["comm_hidden"] <= 1.0


def test_overlap_stats_totals():
    stats = tp.OverlapStats()
    assert stats.summary() == {}
    stats.record("fc2", 0.9, 0.8, 0.3)
    stats.record("proj", 0.5, 0.4, 0.2)
    s = stats.summary()
    assert s["exposed_comm_ms"] == pytest.approx(0.2)               # 0.1 + 0.1
    assert s["comm_hidden"] == pytest.approx(1 - 0.2 / 0.5)        # of 0.5 ms of collectives, 0.2 showed
    assert (s["op_ms"], s["gemm_ms"], s["comm_ms"], s["calls"]) == (pytest.approx(1.4), pytest.approx(1.2),
                                                                   pytest.approx(0.5), 2)


def test_overlap_stats_per_kind_and_scalars():
    stats = tp.OverlapStats()
    stats.record("gemm_rs", 0.9, 0.8, 0.3)
    stats.record("ag_gemm", 0.5, 0.4, 0.2)
    stats.record("gemm_rs", 0.9, 0.8, 0.3)
    s = stats.summary()
    assert list(s["by_kind"]) == ["gemm_rs", "ag_gemm"]
    assert s["by_kind"]["gemm_rs"]["calls"] == 2
    assert s["by_kind"]["gemm_rs"]["comm_hidden"] == pytest.approx(2 / 3)
    assert s["by_kind"]["ag_gemm"]["exposed_comm_ms"] == pytest.approx(0.1)
    scalars = tp.interval_scalars(step_time_s=1.0, global_batch_size=1, seq_length=1, world_size=1,
                                  flops_per_iteration=1e12, overlap=s)
    assert scalars["overlap_tp/gemm_rs/comm_hidden"] == pytest.approx(2 / 3)
    assert scalars["overlap_tp/ag_gemm/exposed_comm_ms"] == pytest.approx(0.1)
    assert scalars["overlap_tp/exposed_comm_ms"] == pytest.approx(0.3)   # 0.1 + 0.1 + 0.1
    assert scalars["overlap_tp/comm_hidden"] == pytest.approx(1 - 0.3 / 0.8)


def test_host_bound_steps_are_left_out_with_the_reason():
    stats = tp.OverlapStats()
    stats.record("gemm_rs", 0.9, 0.8, 0.3, gpu_waited=True)
    stats.record("ag_gemm", 0.5, 0.4, 0.2, gpu_waited=False)
    assert "exposed_comm_ms" in stats.summary()          # 1 of 2: not most of the calls
    stats.record("gemm_rs", 0.9, 0.8, 0.3, gpu_waited=True)
    summary = stats.summary()
    assert summary == {"left_out": summary["left_out"]} and "host-bound" in summary["left_out"]
    assert "2 of 3" in summary["left_out"]
    scalars = tp.interval_scalars(step_time_s=1.0, global_batch_size=1, seq_length=1, world_size=1,
                                  flops_per_iteration=1e12, overlap=summary)
    assert not any("comm" in key for key in scalars)
    line = tp.format_line(10, scalars, left_out=summary["left_out"])
    assert "overlap stats: left out (host-bound" in line and "exposed comm" not in line
    stats.reset()
    assert stats.summary() == {}


def test_no_samples_reasons():
    graphs = SimpleNamespace(cuda_graph_impl="local", overlap_tp="signal")
    assert "--cuda-graph-impl local" in tp.no_samples_reason(graphs)
    assert "Megatron's own layers" in tp.no_samples_reason(SimpleNamespace(overlap_tp="off"))
    assert tp.no_samples_reason(SimpleNamespace(overlap_tp="signal", cuda_graph_impl="none")) == (
        "no overlapped op call ran in the sampled step")
    tp1 = SimpleNamespace(overlap_tp="off", overlap_tp_layers=True, tensor_model_parallel_size=1)
    assert tp.no_samples_reason(tp1).startswith("TP 1: ")


class FakeWriter:
    def __init__(self):
        self.scalars, self.logged = [], []

    def add_scalar(self, key, value, step):
        self.scalars.append((key, value, step))

    def log(self, values, step):
        self.logged.append((values, step))


def test_logger_intervals_writers_and_report_round_trip():
    clock = iter([0.0] + [0.5 * i for i in range(1, 11)])
    lines = []
    stats = tp.OverlapStats()
    logger = tp.ThroughputLogger(llama3_8b_args(), clock=lambda: next(clock), stats=stats, printer=lines.append)
    tb, wb = FakeWriter(), FakeWriter()
    results = {}
    for iteration in range(0, 11):  # the first call (iteration 0) only takes the starting stamp
        if iteration == 8:
            stats.record("fc2", 0.9, 0.8, 0.3)
        results[iteration] = logger.on_log(iteration, tb, wb)
    assert [i for i, r in results.items() if r] == [5, 10]
    scalars = results[10]
    assert scalars["overlap_tp/step_time_ms"] == pytest.approx(500.0)
    assert scalars["overlap_tp/tokens_per_sec_per_gpu"] == pytest.approx(8 * 8192 / (0.5 * 2))
    assert scalars["overlap_tp/tflops_per_gpu"] == pytest.approx(3_373_164_235_063_296 / (0.5e12 * 2))
    assert scalars["overlap_tp/comm_hidden"] == pytest.approx(2 / 3)
    assert scalars["overlap_tp/exposed_comm_ms"] == pytest.approx(0.1)
    assert "overlap_tp/comm_hidden" not in results[5]
    assert {k for k, _, step in tb.scalars if step == 10} == set(scalars)
    assert wb.logged[-1] == (scalars, 10)
    run = parse_log(lines)
    assert run.points[10]["tokens_per_sec_per_gpu"] == pytest.approx(65536.0)
    assert run.points[10]["comm_hidden"] == pytest.approx(0.667)
    assert run.points[10]["exposed_comm_ms"] == pytest.approx(0.1)


def test_logger_prints_the_symmetric_memory_once(monkeypatch):
    """Symmetric memory is outside torch's allocator (Megatron's memory report misses it): the first printed
    interval is followed by one line that says how much this GPU holds; later intervals do not repeat it."""
    from collections import Counter
    from overlap_tp.ops import symmetric
    monkeypatch.setattr(symmetric, "_bytes", Counter({"gathered in place": 2_147_483_648, "signals": 64}))
    clock = iter([0.5 * i for i in range(0, 12)])
    lines = []
    logger = tp.ThroughputLogger(llama3_8b_args(), clock=lambda: next(clock), stats=None, printer=lines.append)
    for iteration in range(0, 11):
        logger.on_log(iteration)
    memory = [line for line in lines if "symmetric memory" in line]
    assert memory == ["[overlap_tp] symmetric memory on this GPU, not in torch's or Megatron's memory report: "
                      "2.15 GB (gathered in place 2.15, signals 0.00)"]
    assert lines.index(memory[0]) == 1   # right after the first interval's line
    assert sorted(parse_log(lines).points) == [5, 10]   # the report's parser reads past it
    monkeypatch.setattr(symmetric, "_bytes", Counter())
    lines.clear()
    clock = iter([0.5 * i for i in range(0, 12)])
    quiet = tp.ThroughputLogger(llama3_8b_args(), clock=lambda: next(clock), stats=None, printer=lines.append)
    for iteration in range(0, 6):
        quiet.on_log(iteration)
    assert len(lines) == 1 and not any("symmetric memory" in line for line in lines)   # nothing allocated: nothing said


def test_hook_wraps_training_log_once():
    calls = []

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kw):
        calls.append(iteration)
        return "flag"

    module = SimpleNamespace(training_log=training_log)
    args = llama3_8b_args(log_interval=1)
    logger = tp.install_training_log_hook(args, module=module)
    assert tp.install_training_log_hook(args, module=module) is logger
    logger.printer = lambda line: None
    assert module.training_log({}, {}, 1e-4, 1, 1.0, False, 0, None, None, None, None) == "flag"
    assert module.training_log({}, {}, 1e-4, iteration=2, loss_scale=1.0, report_memory_flag=False,
                               skipped_iter=0, grad_norm=None, params_norm=None, num_zeros_in_grad=None,
                               max_attention_logit=None) == "flag"
    assert calls == [1, 2] and [i for i, _ in logger.history] == [2]


class FakeSampler:
    """Feeds one fixed record each time it is collected (none with records=0), as after an armed step."""

    def __init__(self, records=1):
        self.collected = 0
        self.records = records
        self.was_armed = True

    def collect(self, stats):
        self.collected += 1
        for _ in range(self.records):
            stats.record("gemm_rs", 0.9, 0.8, 0.3)
        return self.records


def test_logger_collects_samples_and_stamps_after_them():
    times = iter([0.0, 0.25, 1.0, 1.5, 2.0])   # logged calls read the clock before and after collecting
    sampler = FakeSampler()
    logger = tp.ThroughputLogger(llama3_8b_args(log_interval=2), clock=lambda: next(times), stats=tp.OverlapStats(),
                                 sampler=sampler, printer=lambda line: None)
    assert logger.on_log(0) is None          # first call: collects (and drops) what was sampled, stamps
    assert logger.on_log(1) is None          # not a logged iteration: no clock after, no collect
    scalars = logger.on_log(2)
    # the interval runs from the stamp taken after collect (0.25) to this call's start (1.5)
    assert scalars["overlap_tp/step_time_ms"] == pytest.approx((1.5 - 0.25) / 2 * 1e3)
    assert scalars["overlap_tp/gemm_rs/comm_hidden"] == pytest.approx(2 / 3)
    assert logger.last == (2, 2.0) and sampler.collected == 2


def test_a_sampled_step_without_op_calls_says_why():
    """CUDA graphs replay the layers without their Python: the line says so instead of printing figures."""
    lines = []
    times = iter([0.0, 0.0, 1.0, 1.0])
    logger = tp.ThroughputLogger(llama3_8b_args(log_interval=1, cuda_graph_impl="local"), clock=lambda: next(times),
                                 stats=tp.OverlapStats(), sampler=FakeSampler(records=0), printer=lines.append)
    logger.on_log(0)
    scalars = logger.on_log(1)
    assert not any("comm" in key for key in scalars)
    assert "overlap stats: left out (--cuda-graph-impl local: graph replays" in lines[-1]


def _megatron() -> bool:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return False
    return True


def test_hook_arms_the_sampler_for_the_logged_step():
    from overlap_tp.training.sampling import SAMPLER
    armed = []

    def train_step(*a, iteration=None, **kw):
        armed.append(SAMPLER.armed)
        return "step"

    def training_log(*a, **kw):
        return None

    module = SimpleNamespace(training_log=training_log, train_step=train_step)
    args = llama3_8b_args(log_interval=3)
    tp.install_training_log_hook(args, module=module)
    wrapped = module.train_step
    tp.install_training_log_hook(args, module=module)
    assert module.train_step is wrapped    # idempotent
    model = [torch.nn.Linear(2, 2)]        # Megatron's train_step(forward_step_func, data_iterator, model, ...)
    assert [module.train_step(None, None, model, iteration=k) for k in range(6)] == ["step"] * 6
    assert armed == [False, False, True, False, False, True] and SAMPLER.armed is False
    if _megatron():   # without megatron-core there are no layers to observe
        assert model[0] in SAMPLER._attached   # the sampled step's model observes through the sampler
    armed.clear()
    args.overlap_tp_stats = False          # --no-overlap-tp-stats
    module.train_step(None, None, model=model, iteration=2)
    assert armed == [False]


def test_matches_megatrons_own_count():
    training = pytest.importorskip(
        "megatron.training.training",
        reason="megatron.training is not importable (megatron-core >= 0.19 on Python >= 3.12 ships it)")
    from megatron.training import arguments
    recipe = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
              "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
              "--kv-channels", "128", "--seq-length", "8192", "--max-position-embeddings", "8192", "--swiglu",
              "--micro-batch-size", "1", "--global-batch-size", "8"]
    saved, sys.argv = sys.argv, ["x"] + recipe
    try:
        args = arguments.parse_args()
    finally:
        sys.argv = saved
    args.padded_vocab_size = 128256
    assert training.num_floating_point_operations(args, 8) == tp.flops_from_args(args) == 3_373_164_235_063_296
