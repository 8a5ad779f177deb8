"""A one-thread wait on a device word with a deadline: what a captured CUDA graph waits with.

    wait until *word == target, then *word = 0          (as a stream wait-value + write-value does eagerly)
    but if timeout_s > 0 and the word is still not there timeout_s seconds after the wait started:
        write (code << 32) | seen into the watchdog's mailbox (pinned host memory, a system-scope store),
        spin GRACE_NS more (the host's watchdog thread reads the mailbox, prints the plan and the wait the
        code names, and ends the process), then `trap`: the kernel, and so the replay, ends in an error
        instead of hanging.

An eager call's waits sit behind an event the host watchdog polls (overlap_tp/ops/watchdog.py), but an event
recorded inside a capture cannot be queried from outside it, so a replayed graph is watched from the device:
the clock is %globaltimer (nanoseconds, the same on every SM). timeout_s = 0 spins forever (the watchdog off).

The spin holds one thread slot of one SM; why the comm stream waits with a kernel under capture rather than a
stream wait-value is written at CommEngine.wait_counter (overlap_tp/ops/comm.py). Loads are acquire (gpu scope)
as in the signaled GEMM, so what the producer wrote before its release is visible after the wait.

DeadlineWait launches the kernel on a given raw stream with raw word addresses (a peer signal's word, a
counter), without Triton's JIT dispatch: it is compiled once per device, eagerly, by prepare() (no compile may
happen inside a capture), and no argument is specialized, so that one binary serves every word and target.
Under TRITON_INTERPRET=1 (CPU) the kernel spins with the interpreter's atomics and has no deadline: the
interpreter runs no inline PTX.
"""
import torch
import triton
import triton.language as tl

from overlap_tp.kernels.direct_launch import DirectKernel
from overlap_tp.kernels.signaled_gemm import INTERPRET, load_acquire

GRACE_NS = tl.constexpr(2_000_000_000)   # from the mailbox record to the trap: the host's watchdog polls every <= 0.5 s


@triton.jit
def globaltimer_after(value):
    """%globaltimer in ns; `value` orders the read after whatever produced it (the asm takes it as an input)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [value], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def report_then_trap(mailbox_ptr, record, now):
    """A system-scope store of `record` into the host-mapped mailbox, fenced so the host sees it, a grace
    period for the host's watchdog to report it, then `trap` (the launch fails: the stream errors out)."""
    done = tl.inline_asm_elementwise("st.relaxed.sys.global.b64 [$1], $2;\n\tfence.sc.sys;\n\tmov.u32 $0, 0;",
                                     "=r,l,l", [mailbox_ptr, record], dtype=tl.int32, is_pure=False, pack=1)
    until = now + GRACE_NS
    while globaltimer_after(done) < until:
        pass
    tl.inline_asm_elementwise("trap;\n\tmov.u32 $0, 0;", "=r,r", [done], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["target", "timeout_s", "code"],
            do_not_specialize_on_alignment=["word_ptr", "mailbox_ptr"])
def deadline_wait_kernel(word_ptr, target, timeout_s, mailbox_ptr, code, INTERPRETED: tl.constexpr):
    """Spin until *word_ptr == target, then write 0 back; past timeout_s (> 0) report `code` and the value
    seen into mailbox_ptr[0] and trap. Launch with one program of one warp."""
    if INTERPRETED:
        while tl.atomic_add(word_ptr, 0) != target:
            pass
    else:
        seen = load_acquire(word_ptr)
        if seen != target:
            now = globaltimer_after(seen)
            forever = timeout_s <= 0
            deadline = now + (timeout_s * 1e9).to(tl.int64)
            while (seen != target) & (forever | (now < deadline)):
                seen = load_acquire(word_ptr)
                now = globaltimer_after(seen)
            if seen != target:
                report_then_trap(mailbox_ptr, (code.to(tl.int64) << 32) | seen.to(tl.uint32).to(tl.int64), now)
    tl.store(word_ptr, 0)


class DeadlineWait:
    """deadline_wait_kernel on one device, compiled once by prepare() and then launched as a DirectKernel (as
    SumSlots and SignaledGemm are) on any stream, with the word's raw address."""

    def __init__(self, device: torch.device):
        self.device = device
        self.kernel = None

    def prepare(self, mailbox: torch.Tensor):
        """Compile (eagerly, never under capture) by running one wait that passes at once."""
        if self.kernel is None and not INTERPRET:
            scratch = torch.ones(1, dtype=torch.int32, device=self.device)
            self.kernel = DirectKernel(deadline_wait_kernel[(1,)](scratch, 1, 0.0, mailbox, 0, INTERPRET, num_warps=1))
            torch.cuda.synchronize(self.device)

    def __call__(self, stream: int, word: int, target: int, timeout_s: float, mailbox: torch.Tensor, code: int):
        """On `stream`: wait until the int32 at device address `word` == target, then reset it to 0; past
        timeout_s report `code` into `mailbox` (int64, pinned host memory) and trap."""
        self.kernel(1, stream, word, target, float(timeout_s), mailbox, code, INTERPRET)
