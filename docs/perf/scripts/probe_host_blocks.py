# The host's price of the building blocks an eager plan call is made of (session 40, issue 20): tensor attributes,
# output allocation in its several spellings, ctypes calls with and without prototypes, a batched stream memory
# operation, a Triton launch through the C launcher; one process, one GPU, each block timed in bursts of 64 behind a
# sleep, interleaved round by round, median per call.
#   python3 docs/perf/scripts/probe_host_blocks.py [--rounds R] [--burst B]
import ctypes, statistics, sys, time
import torch
from overlap_tp.ops import memops
from overlap_tp.tune.timing import sleep_cycles_per_ms

ROUNDS = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 20
BURST = int(sys.argv[sys.argv.index("--burst") + 1]) if "--burst" in sys.argv else 64
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
a = torch.randn(8192, 2048, device=dev, dtype=torch.bfloat16)
w = torch.randn(4096, 2048, device=dev, dtype=torch.bfloat16)
proto = torch.empty(0, device=dev, dtype=torch.bfloat16)
word = torch.ones(1, dtype=torch.int32, device=dev)
stream = torch._C._cuda_getCurrentRawStream(0)
lib = memops._driver()
batch1 = memops.MemOps([("wait", word.data_ptr(), 1)])
batch2 = memops.MemOps([("write", word.data_ptr(), 1), ("wait", word.data_ptr(), 1)])
libc = ctypes.CDLL(None)
labs = libc.labs
labs.argtypes, labs.restype = [ctypes.c_long], ctypes.c_long
unproto = ctypes.CDLL(None).labs
raw_batch = lib.cuStreamBatchMemOp_v2
addr = batch2._address
sizes = (4096, 4096)
empty, bf16 = torch.empty, torch.bfloat16
aten_empty = torch.ops.aten.empty.memory_format
cycles = sleep_cycles_per_ms()

blocks = {
    "python call (lambda: None)": lambda: None,
    "a.data_ptr()": lambda: a.data_ptr(),
    "a.shape": lambda: a.shape,
    "a.shape == w.shape": lambda: a.shape == w.shape,
    "a.stride()": lambda: a.stride(),
    "a.is_contiguous()": lambda: a.is_contiguous(),
    "a.dtype": lambda: a.dtype,
    "a.device": lambda: a.device,
    "a.device == dev": lambda: a.device == dev,
    "a.is_cuda": lambda: a.is_cuda,
    "a.get_device()": lambda: a.get_device(),
    "is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
    "_cuda_isCurrentStreamCapturing": torch._C._cuda_isCurrentStreamCapturing,
    "_cuda_getCurrentRawStream(0)": lambda: torch._C._cuda_getCurrentRawStream(0),
    "torch.empty(m, n, dtype, device)": lambda: empty(4096, 4096, dtype=bf16, device=dev),
    "torch.empty(sizes, dtype, device)": lambda: empty(sizes, dtype=bf16, device=dev),
    "torch.empty(..., device='cuda:0')": lambda: empty(sizes, dtype=bf16, device="cuda:0"),
    "proto.new_empty(sizes)": lambda: proto.new_empty(sizes),
    "aten.empty.memory_format": lambda: aten_empty(sizes, dtype=bf16, device=dev),
    "torch.empty CPU": lambda: empty(sizes, dtype=bf16),
    "a.view(2, 4096, 2048)": lambda: a.view(2, 4096, 2048),
    "ctypes labs (argtypes)": lambda: labs(-3),
    "ctypes labs (no argtypes)": lambda: unproto(-3),
    "memop 1 wait (MemOps.issue)": lambda: batch1.issue(stream),
    "memop write+wait (MemOps.issue)": lambda: batch2.issue(stream),
    "memop write+wait (raw ctypes)": lambda: raw_batch(stream, 2, addr, 0),
    "cuEventRecord (memops.Event)": None,
}
event = memops.Event()
blocks["cuEventRecord (memops.Event)"] = lambda: event.record(stream)
for fn in blocks.values():
    fn()
times = {name: [] for name in blocks}
for _ in range(ROUNDS):
    for name, fn in blocks.items():
        torch.cuda.synchronize()
        torch.cuda._sleep(int(20 * cycles))
        t0 = time.perf_counter()
        for _ in range(BURST):
            fn()
        times[name].append((time.perf_counter() - t0) / BURST * 1e6)
torch.cuda.synchronize()
print(f"burst {BURST}\n{'block':<38} {'us/call':>8} {'min':>7}")
for name, values in times.items():
    print(f"{name:<38} {statistics.median(values):8.2f} {min(values):7.2f}")
