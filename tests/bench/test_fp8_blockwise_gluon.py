"""benchmarks/device/fp8_blockwise_gluon.py compiled for sm_90 on the CPU (Triton's own ptxas and cuobjdump): its
SASS keeps the second K step's MMAs in flight while the first is promoted (one wait for at most one group, one wait
for none, per loop iteration, and no other), with no register spills; a loop that waits for every MMA at once
fails the check. Its numbers against float64 and cuBLAS come from fp8_blockwise_variants.py on a GPU."""
import importlib.util
import os
import subprocess

import pytest

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper", reason="this Triton has no Gluon for Hopper")
import triton  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE = os.path.join(ROOT, "benchmarks", "device", "fp8_blockwise_gluon.py")
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _sass(path, tmp_path, **tile):
    spec = importlib.util.spec_from_file_location(f"gluon_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = module.compile_sm90(**tile)
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    sass = subprocess.run([CUOBJDUMP, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([CUOBJDUMP, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    return sass, usage


def _overlapped(sass):
    return (sass.count("WARPGROUP.DEPBAR") == 2 and sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x1") == 1
            and sass.count("QGMMA") == 8)


@pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="this Triton ships no cuobjdump")
@pytest.mark.parametrize("tile", [dict(block_m=64, block_n=128, stages=4, num_warps=4),
                                  dict(block_m=128, block_n=128, stages=3, num_warps=8)])
def test_the_promotion_runs_while_the_next_mmas_are_in_flight(tmp_path, tile):
    sass, usage = _sass(SOURCE, tmp_path, **tile)
    assert _overlapped(sass), [line.strip() for line in sass.splitlines() if "WARPGROUP" in line]
    assert "LOCAL:0" in usage, usage   # no spills


@pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="this Triton ships no cuobjdump")
def test_a_loop_that_waits_for_every_mma_fails_the_check(tmp_path):
    source = open(SOURCE).read()
    broken = source.replace("warpgroup_mma_wait(num_outstanding=1, deps=(x, ))",
                            "warpgroup_mma_wait(num_outstanding=0, deps=(x, ))")
    assert broken != source
    path = tmp_path / "broken.py"
    path.write_text(broken)
    sass, _ = _sass(path, tmp_path)
    assert not _overlapped(sass)
