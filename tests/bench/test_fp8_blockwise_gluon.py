"""benchmarks/device/fp8_blockwise_gluon.py compiled for sm_90 on the CPU (Triton's own ptxas and cuobjdump): its
SASS keeps the second K step's MMAs in flight while the first is promoted (one wait for at most one group, one wait
for none, per loop iteration, and no other), with no register spills; a loop that waits for every MMA at once
fails the check. Its epilogue is the library's: the CTA barrier before the release signal, the acquire spin and the
async-proxy fence before the TMA loads, and the tile stored two bf16 per store at least. Its numbers against float64
and cuBLAS come from fp8_blockwise_variants.py on a GPU. The warp-specialised 128x256 kernel (gluon-ws) compiles
to two consumer partitions tied by no CTA barrier."""
import importlib.util
import os
import re
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
    return sass, usage, kernel.asm["ptx"]


def _overlapped(sass):
    return (sass.count("WARPGROUP.DEPBAR") == 2 and sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x1") == 1
            and sass.count("QGMMA") == 8)


@pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="this Triton ships no cuobjdump")
@pytest.mark.parametrize("tile", [dict(block_m=64, block_n=128, stages=4, num_warps=4),
                                  dict(block_m=128, block_n=128, stages=3, num_warps=8)])
def test_the_promotion_runs_while_the_next_mmas_are_in_flight(tmp_path, tile):
    sass, usage, _ = _sass(SOURCE, tmp_path, **tile)
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
    sass, _, _ = _sass(path, tmp_path)
    assert not _overlapped(sass)


@pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="this Triton ships no cuobjdump")
def test_the_epilogue_and_the_wait_are_the_librarys(tmp_path):
    _, _, ptx = _sass(SOURCE, tmp_path)
    release = re.search(r"(atom|red)\.global\.gpu\.release\.add", ptx).start()   # red where the result is unused
    last_store, barrier = ptx.rfind("st.global", 0, release), ptx.rfind("bar.sync", 0, release)
    assert 0 <= last_store < barrier < release, "the tile's stores are ordered before the signal by a CTA barrier"
    acquire, fence = ptx.find("ld.global.acquire.gpu.b32"), ptx.find("fence.proxy.async.global")
    assert 0 <= acquire < fence, "the wait acquires, then fences the async proxy"
    assert "st.global.b16" not in ptx and "st.global.b32" in ptx, "the tile is stored two bf16 per store"


@pytest.mark.skipif(not os.path.exists(CUOBJDUMP), reason="this Triton ships no cuobjdump")
def test_the_warp_specialised_consumers_share_no_barrier_but_the_signals(tmp_path):
    """gluon-ws: two consumer partitions of one warpgroup each (8 warps, so 255 registers a thread), each with its
    own 128-thread barriers and one arrive per stage on the ring's empty barrier (count 2), 16 QGMMA (two
    partitions x two 128-column halves x four k32 steps); the only barrier of both (256 threads) comes after a
    tile's stores and before its one release signal; the flag wait acquires, then fences the async proxy. ptxas
    keeps one half's product in flight while the other is promoted, a few registers past the file, so a little
    spills (under 256 bytes of stack a thread)."""
    spec = importlib.util.spec_from_file_location("gluon_ws", SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = module.compile_ws_sm90()
    cubin = tmp_path / "ws.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    sass = subprocess.run([CUOBJDUMP, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([CUOBJDUMP, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    ptx = kernel.asm["ptx"]
    assert sass.count("QGMMA") == 16
    assert ptx.count("mbarrier.arrive.shared::cta.b64") == 2
    barriers = re.findall(r"\bbar\.sync\s+(\d+)(?:,\s*(\d+))?;", ptx)
    assert {b for b in barriers if b[1] == "128"} == {("0", "128"), ("2", "128")}   # one per consumer partition
    assert [b for b in barriers if b[1] != "128"] == [("8", "256")] * 2, barriers   # both consumers, once each
    release = re.search(r"(atom|red)\.global\.gpu\.release\.add", ptx).start()
    assert len(re.findall(r"(atom|red)\.global\.gpu\.release\.add", ptx)) == 1
    last_store, barrier = ptx.rfind("st.global", 0, release), ptx.rfind("bar.sync 8, 256", 0, release)
    assert 0 <= last_store < barrier < release
    acquire = ptx.find("ld.global.acquire.gpu.b32")
    assert 0 <= acquire < ptx.find("fence.proxy.async.global", acquire)
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    assert stack < 256, usage


def test_each_launcher_refuses_the_tiles_its_kernel_does_not_take():
    spec = importlib.util.spec_from_file_location("gluon_launch", SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from overlap_tp.kernels import fp8_quant as Q
    import torch
    a = Q.quantize_1x128_reference(torch.randn(128, 512).bfloat16())
    w = Q.quantize_128x128_reference(torch.randn(256, 512).bfloat16())
    out, tiles = torch.empty(128, 256, dtype=torch.bfloat16), torch.zeros(1, 9, dtype=torch.int32)
    for launch, tile in ((module.launch, (64, 256, 128, 4, 4)),       # wider than one weight block
                         (module.launch, (128, 128, 128, 4, 4)),      # BLOCK_M is 16 per warp
                         (module.launch, (64, 128, 128, 2, 4)),       # the ring needs 3 stages
                         (module.launch_ws, (64, 128, 128, 4, 4)),    # gluon-ws takes 128x256x128 only
                         (module.launch_ws, (128, 256, 128, 1, 4))):  # and 2 stages at least
        with pytest.raises(ValueError, match="does not take"):
            launch(a, w, out, tile, 4, tiles)
    t = Q.quantize_tensorwise_reference(torch.randn(128, 512).bfloat16())
    with pytest.raises(ValueError, match="does not take tensorwise"):
        module.launch(t, Q.quantize_tensorwise_reference(torch.randn(256, 512).bfloat16()), out,
                      (64, 128, 128, 4, 4), 4, tiles)
