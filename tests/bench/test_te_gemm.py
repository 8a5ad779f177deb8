"""The FP8 GEMM anchor (overlap_tp.bench te_gemm) on the CPU: its arguments, the torch-side quantization against
float64 (what its scaled_mm checks compare with), the blockwise scale layouts it offers torch._scaled_mm, the
GEMMs it takes (the layers' forward GEMMs) and its results.jsonl-style records. The timing runs on the GPU
(benchmarks/device/te_checks.sh)."""
import pytest
import torch

from overlap_tp.bench import te_gemm


def test_arguments():
    args = te_gemm.parse_args([])
    assert (args.tp, args.seq, args.layers) == (2, 8192, "l8b,l70b")
    assert args.recipes == "Float8CurrentScaling,Float8BlockScaling"
    for bad in (["--recipes", "DelayedScaling"], ["--layers", "l9b"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            te_gemm.parse_args(bad)


def test_main_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert te_gemm.main([]) == 2 and "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("rows", [1, 128])
def test_block_quantization_round_trips_within_e4m3(rows):
    torch.manual_seed(0)
    t = torch.randn(256, 384) * torch.logspace(-3, 3, 384)   # columns of very different magnitude
    q, scale = te_gemm.quantize_blocks(t, rows)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (256 // rows, 3)
    back = te_gemm.dequantize_blocks(q, scale, rows)
    blocks_amax = t.abs().reshape(256 // rows, rows, 3, 128).amax(dim=(1, 3))
    assert torch.allclose(scale.double(), blocks_amax.double() / te_gemm.E4M3_MAX)
    # E4M3 keeps 3 mantissa bits: every element within 2^-4 of its value, relative to its block's amax below that
    err = (back - t.double()).abs()
    bound = torch.maximum(t.double().abs() * 2 ** -4, blocks_amax.double().repeat_interleave(rows, 0)
                          .repeat_interleave(128, 1) * 2 ** -9)
    assert bool((err <= bound).all())
    with pytest.raises(ValueError, match="needs 128 | rows and 128 | columns"):
        te_gemm.quantize_blocks(torch.randn(100, 256), 128)


def test_tensorwise_quantization_uses_the_amax():
    t = torch.tensor([[1.0, -896.0], [3.0, 0.5]])
    q, scale = te_gemm.quantize_tensorwise(t)
    assert float(scale) == 2.0 and q.float()[0, 1] == -448.0


def test_blockwise_scale_layouts():
    xs, ws = torch.rand(512, 4), torch.rand(6, 4)   # activations [M, K/128], weights [N/128, K/128]
    layouts = te_gemm.blockwise_scale_layouts(xs, ws)
    assert [name for name, _, _ in layouts] == ["outer-major", "row-major"]
    for _, a, b in layouts:
        assert a.shape == (512, 4) and b.shape == (4, 6) and torch.equal(a, xs) and torch.equal(b, ws.t())
    (_, a, b), (_, a2, b2) = layouts
    assert a.stride() == (1, 512) and b.stride() == (1, 4) and a2.stride() == (4, 1) and b2.stride() == (6, 1)


def test_the_gemms_are_the_layers_forward_gemms():
    from overlap_tp.bench.gemm import layer_gemms
    forward = [(name, k, n) for name, _, k, n, _ in layer_gemms("l8b", 8192, 2) if name.endswith(" fwd")]
    assert forward == [("l8b.qkv fwd", 4096, 3072), ("l8b.fc1 fwd", 4096, 14336), ("l8b.proj fwd", 2048, 4096),
                       ("l8b.fc2 fwd", 7168, 4096)]


def test_jsonl_records(monkeypatch):
    monkeypatch.setenv("OVERLAP_TP_GIT_COMMIT", "abc1234")
    args = te_gemm.parse_args([])
    rows = [dict(gemm="l8b.qkv.s8192", M=8192, K=4096, N=3072, variant="te Float8BlockScaling W cached", ms=0.25,
                 tflops=824.6, timing="graph"),
            dict(gemm="l8b.qkv.s8192", M=8192, K=4096, N=3072, variant="scaled_mm blockwise", error="RuntimeError")]
    records = te_gemm.jsonl_records(rows, args, "1x NVIDIA H100 80GB HBM3", "2.20.2")
    assert [r["metric"] for r in records] == ["ms", "TFLOP/s"] and records[0]["value"] == 0.25
    first = records[0]
    assert set(first) == {"date", "commit", "cards", "t", "what", "config", "metric", "value", "record", "logs"}
    assert first["commit"] == "abc1234" and first["t"] == 2 and first["what"] == "FP8 GEMM anchor l8b.qkv.s8192 fwd"
    assert first["config"]["transformer_engine"] == "2.20.2" and first["config"]["variant"].startswith("te ")
