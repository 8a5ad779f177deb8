"""benchmarks/device/fp8_blockwise_variants.py's own check on the CPU (--cpu: Triton's interpreter): every main-loop
variant of the blockwise FP8 GEMM equals the float64 product of the dequantized operands within 2**-6, on operands
whose blocks differ in magnitude (a scale applied to the wrong block fails), and a broken variant fails the script."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "device", "fp8_blockwise_variants.py")


def _run(script, *args):
    return subprocess.run([sys.executable, script, "--cpu", *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])))


def test_every_variant_passes_its_check_in_the_interpreter():
    run = _run(SCRIPT, "--variants", "outer,rowscale,unroll2,ws")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    for variant in ("outer", "rowscale", "unroll2", "ws"):
        assert f" {variant} (64, 128): 0.00" in run.stdout, run.stdout[-2000:]


def test_a_variant_that_drops_the_weight_scale_fails(tmp_path):
    source = open(SCRIPT).read()
    broken = source.replace("tl.dot(a, w.T) * (sa * sw)[:, None]", "tl.dot(a, w.T) * sa[:, None]")
    assert broken != source
    script = tmp_path / "broken.py"
    script.write_text(broken)
    run = _run(str(script), "--variants", "rowscale")
    assert run.returncode != 0 and "variants failed their check" in run.stderr, run.stdout[-1000:] + run.stderr[-1000:]


def test_operand_bytes_count_each_tiles_rows_of_a_and_w_over_k():
    import importlib.util
    spec = importlib.util.spec_from_file_location("variants_for_bytes", SCRIPT)
    variants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(variants)
    # the 8B layer's qkv forward at t = 2: 128 x 24 tiles of 64x128, each (64 + 128) rows x K bytes
    assert variants.operand_bytes(8192, 3072, 4096, (64, 128, 128, 3, 4)) == 128 * 24 * 192 * 4096
    # a ragged edge counts as a whole tile (the kernel loads it whole); 128x128 loads 2/3 of 64x128's bytes
    assert variants.operand_bytes(100, 130, 256, (64, 128, 128, 3, 4)) == 2 * 2 * 192 * 256
    small = variants.operand_bytes(8192, 3072, 4096, (64, 128, 128, 3, 4))
    assert variants.operand_bytes(8192, 3072, 4096, (128, 128, 128, 4, 8)) * 3 == small * 2
    assert variants.parse_tile("128x128x128/4/8") == (128, 128, 128, 4, 8)
