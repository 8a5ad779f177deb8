"""FLOPs (Megatron's analytic count), tokens/s/GPU, TFLOP/s/GPU, MFU and overlap statistics against
hand-worked numbers; the logging hook with a stand-in for Megatron's training module."""
import sys
from types import SimpleNamespace

import pytest

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


def test_overlap_efficiency_and_exposed_comm():
    # GEMM 0.8 ms, collective 0.3 ms, sequential 1.1 ms, overlapped 0.9 ms: 0.2 of an ideal 0.3 saved
    assert tp.overlap_efficiency(0.9, 1.1, 0.8, 0.3) == pytest.approx(2 / 3)
    assert tp.exposed_comm_ms(0.9, 0.8) == pytest.approx(0.1)
    assert tp.exposed_comm_ms(0.7, 0.8) == 0.0
    assert tp.overlap_efficiency(0.8, 1.1, 0.8, 0.3) == pytest.approx(1.0)
    assert tp.overlap_efficiency(1.2, 1.1, 0.8, 0.3) < 0
    assert tp.overlap_efficiency(1.0, 0.8, 0.8, 0.0) is None


def test_overlap_stats_totals():
    stats = tp.OverlapStats()
    assert stats.summary() == {}
    stats.record("fc2", 0.9, 1.1, 0.8, 0.3)
    stats.record("proj", 0.5, 0.6, 0.4, 0.2)
    s = stats.summary()
    # sequential 1.7, overlapped 1.4, ideal max(...) sum 1.2 -> efficiency 0.3 / 0.5
    assert s["overlap_efficiency"] == pytest.approx(0.6)
    assert s["exposed_comm_ms"] == pytest.approx(0.2)
    assert s["speedup"] == pytest.approx(1.7 / 1.4)


def test_overlap_stats_per_kind_and_scalars():
    stats = tp.OverlapStats()
    stats.record("gemm_rs", 0.9, 1.1, 0.8, 0.3)
    stats.record("ag_gemm", 0.5, 0.6, 0.4, 0.2)
    stats.record("gemm_rs", 0.9, 1.1, 0.8, 0.3)
    s = stats.summary()
    assert list(s["by_kind"]) == ["gemm_rs", "ag_gemm"]
    assert s["by_kind"]["gemm_rs"]["calls"] == 2
    assert s["by_kind"]["gemm_rs"]["overlap_efficiency"] == pytest.approx(2 / 3)   # 0.4 of an ideal 0.6
    assert s["by_kind"]["ag_gemm"]["exposed_comm_ms"] == pytest.approx(0.1)
    scalars = tp.interval_scalars(step_time_s=1.0, global_batch_size=1, seq_length=1, world_size=1,
                                  flops_per_iteration=1e12, overlap=s)
    assert scalars["overlap_tp/gemm_rs/overlap_efficiency"] == pytest.approx(2 / 3)
    assert scalars["overlap_tp/ag_gemm/exposed_comm_ms"] == pytest.approx(0.1)
    assert scalars["overlap_tp/exposed_comm_ms"] == pytest.approx(0.3)   # 0.1 + 0.1 + 0.1


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
            stats.record("fc2", 0.9, 1.1, 0.8, 0.3)
        results[iteration] = logger.on_log(iteration, tb, wb)
    assert [i for i, r in results.items() if r] == [5, 10]
    scalars = results[10]
    assert scalars["overlap_tp/step_time_ms"] == pytest.approx(500.0)
    assert scalars["overlap_tp/tokens_per_sec_per_gpu"] == pytest.approx(8 * 8192 / (0.5 * 2))
    assert scalars["overlap_tp/tflops_per_gpu"] == pytest.approx(3_373_164_235_063_296 / (0.5e12 * 2))
    assert scalars["overlap_tp/overlap_efficiency"] == pytest.approx(2 / 3)
    assert "overlap_tp/overlap_efficiency" not in results[5]
    assert {k for k, _, step in tb.scalars if step == 10} == set(scalars)
    assert wb.logged[-1] == (scalars, 10)
    run = parse_log(lines)
    assert run.points[10]["tokens_per_sec_per_gpu"] == pytest.approx(65536.0)
    assert run.points[10]["overlap_efficiency"] == pytest.approx(0.667)


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
    """Feeds one fixed record each time it is collected."""

    def __init__(self):
        self.collected = 0

    def collect(self, stats):
        self.collected += 1
        stats.record("gemm_rs", 0.9, 1.1, 0.8, 0.3)
        return 1


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
    assert scalars["overlap_tp/gemm_rs/overlap_efficiency"] == pytest.approx(2 / 3)
    assert logger.last == (2, 2.0) and sampler.collected == 2


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
    assert [module.train_step(None, iteration=k) for k in range(6)] == ["step"] * 6
    assert armed == [False, False, True, False, False, True] and SAMPLER.armed is False
    armed.clear()
    args.overlap_tp_stats = False          # --no-overlap-tp-stats
    module.train_step(None, iteration=2)
    assert armed == [False]


def test_matches_megatrons_own_count():
    training = pytest.importorskip(
        "megatron.training.training",
        reason="megatron.training is not importable (megatron-core >= 0.17 on Python >= 3.12 ships it)")
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
