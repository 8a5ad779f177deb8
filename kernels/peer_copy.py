"""The p2p AllGather's pulls done by SMs, with the handshakes inside the kernel: one launch per call.

ops/p2p_gather.py GatherBuffer keeps a gathered [t * m, k] buffer on every rank; rank p's own rows are region p of its
buffer. A call pulls, for every peer p and every chunk c = rows [lo_c, hi_c),

    ours[p * m + i, :] = peer_p's buffer[p * m + i, :]          lo_c <= i < hi_c

with `programs` CTAs on the SMs a persistent GEMM beside it leaves free (comm_sms): each peer's buffer is mapped
into our address space, so a plain load reads it over NVLink. Alone the SMs move no more bytes per second than the
copy engines. What the kernel removes is the fixed cost around the data: inside a CUDA graph a stream memory
operation's cross-GPU hop, and a flag written behind a copy, each cost several times a kernel's store and spin
(docs/performance.md). The copy-engine path has three such per call (the READY exchange, a flag per chunk,
PULLED); here they are stores and spins of the kernel itself:

    program 0:        READY -> every peer (release, system scope: our staged shard is visible to it)
    every program:    spin until every peer's READY reached us (acquire, system scope)
    per chunk c:      its share of the chunk's rows; then counts itself on counters[c] (acq_rel, gpu scope);
                      the chunk's last program resets the counter and raises flags[c] (release): the GEMM's tiles of
                      chunk c wait on it (acquire + fence.proxy.async before their TMA loads, kernels/signaled_gemm.py)
    the last program: resets our READY words and its own counter, then PULLED -> every peer (release, system scope):
                      its loads of the peer's region are done, the peer may stage its next shard there

The READY words are reset before PULLED goes out, as GatherBuffer's memory operations do (its order argument holds
as it is). Counters and flags are device state that returns to its starting value in every call, so a captured
graph replays it. A READY that never comes ends in the watchdog's report and a trap after `timeout_s`
(kernels/deadline_wait.py), not a hang; timeout_s = 0 spins forever.
"""
import torch
import triton
import triton.language as tl

from overlap_tp.kernels.deadline_wait import globaltimer_after, report_then_trap
from overlap_tp.kernels.direct_launch import INTERPRET, DirectKernel

BLOCK = 16384     # elements per program per step: 64 per thread at 8 warps (eight 16-byte loads in flight)
NUM_WARPS = 8


@triton.jit
def wait_raised(word_ptr, timeout_s, mailbox_ptr, code, INTERPRETED: tl.constexpr):
    """Spin until the int32 *word_ptr == 1 (acquire, system scope: a peer raised it); past timeout_s (> 0) report
    `code` and the value seen into the watchdog's mailbox and trap."""
    if INTERPRETED:
        while tl.atomic_add(word_ptr, 0) != 1:
            pass
    else:
        seen = tl.atomic_add(word_ptr, 0, sem="acquire", scope="sys")
        if seen != 1:
            now = globaltimer_after(seen)
            forever = timeout_s <= 0
            deadline = now + (timeout_s * 1e9).to(tl.int64)
            while (seen != 1) & (forever | (now < deadline)):
                seen = tl.atomic_add(word_ptr, 0, sem="acquire", scope="sys")
                now = globaltimer_after(seen)
            if seen != 1:
                report_then_trap(mailbox_ptr, (code.to(tl.int64) << 32) | seen.to(tl.uint32).to(tl.int64), now)


@triton.jit(do_not_specialize=["num_chunks", "timeout_s", "code"])
def signaled_pull_kernel(buf_ptr, src_offsets_ptr, dst_offsets_ptr, chunks_ptr, num_chunks, row_elems,
                         words_ptr, ready_in_ptr, ready_out_ptr, pulled_out_ptr, counters_ptr, flags_ptr,
                         timeout_s, mailbox_ptr, code,
                         PEERS: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr, INTERPRETED: tl.constexpr):
    """The call of the module doc. buf: our gathered buffer; src_offsets[j] / dst_offsets[j]: where peer j's region
    lies in its buffer (mapped here) and in ours, in elements from buf_ptr (one flat address space, as the signaled
    GEMM's epilogue addresses the peers: no integer-to-pointer casts, so alignment hints hold); chunks: int32
    [num_chunks, 2] local rows (lo, hi); words: our signal words (int32); ready_in[j]: the word peer j raises here,
    ready_out[j] / pulled_out[j]: ours in peer j's memory, in words from words_ptr; counters: int32
    [num_chunks + 1], zero between calls; flags: the GEMM's ready flags, raised to 1. num_chunks < 0: nothing (the
    launch that compiles the kernel)."""
    if num_chunks >= 0:
        pid, programs = tl.program_id(0), tl.num_programs(0)
        if pid == 0:   # our shard was staged before this kernel (stream order): the peers may read it
            for j in tl.static_range(PEERS):
                tl.atomic_xchg(words_ptr + tl.load(ready_out_ptr + j), 1, sem="release", scope="sys")
        for j in tl.static_range(PEERS):
            wait_raised(words_ptr + tl.load(ready_in_ptr + j), timeout_s, mailbox_ptr, code, INTERPRETED)
        tl.debug_barrier()   # the CTA's loads below come after the acquire
        for c in range(num_chunks):
            lo, hi = tl.load(chunks_ptr + 2 * c), tl.load(chunks_ptr + 2 * c + 1)
            start, count = lo * row_elems, (hi - lo) * row_elems
            blocks = tl.cdiv(count, BLOCK)
            for j in tl.static_range(PEERS):
                src = buf_ptr + tl.multiple_of(tl.load(src_offsets_ptr + j), ALIGN)
                dst = buf_ptr + tl.multiple_of(tl.load(dst_offsets_ptr + j), ALIGN)
                for b in range(pid, blocks, programs):
                    offs = start + b * BLOCK + tl.arange(0, BLOCK)   # int32: a region has fewer than 2**31 elements
                    mask = offs < start + count
                    tl.store(dst + offs, tl.load(src + offs, mask=mask, cache_modifier=".cg"), mask=mask)
            tl.debug_barrier()   # every thread's stores of the chunk before the count (release: cumulative)
            if tl.atomic_add(counters_ptr + c, 1, sem="acq_rel", scope="gpu") == programs - 1:
                tl.store(counters_ptr + c, 0)
                tl.atomic_xchg(flags_ptr + c, 1, sem="release", scope="gpu")
        tl.debug_barrier()
        if tl.atomic_add(counters_ptr + num_chunks, 1, sem="acq_rel", scope="gpu") == programs - 1:
            # every program has passed its READY waits and done its loads of the peers' regions
            tl.store(counters_ptr + num_chunks, 0)
            for j in tl.static_range(PEERS):
                tl.store(words_ptr + tl.load(ready_in_ptr + j), 0)
            for j in tl.static_range(PEERS):
                tl.atomic_xchg(words_ptr + tl.load(pulled_out_ptr + j), 1, sem="release", scope="sys")


def reference_pull(buf: torch.Tensor, sources, dst_offsets, chunks, row_elems: int):
    """The data movement in torch: buf (flat) at dst_offsets[j] + rows [lo, hi) of every chunk, from sources[j]."""
    for lo, hi in chunks:
        for src, off in zip(sources, dst_offsets):
            buf[off + lo * row_elems:off + hi * row_elems] = src[lo * row_elems:hi * row_elems]


class SignaledPull:
    """One gathered buffer's pulls and handshakes on `programs` CTAs, for a fixed list of chunks: every table on the
    device, made once, the kernel compiled at construction (a first launch inside a capture, or beside a persistent
    GEMM spinning on the flags it raises, could not load its module: CUDA's lazy loading may wait for the running
    kernels, a deadlock). __call__(stream) is one launch.

    src_offsets / dst_offsets: the peers' regions (in the order they are read: ring order) and ours, in elements from
    buf; words: our int32 signal words; ready_in / ready_out / pulled_out: word offsets from words (see the kernel);
    flags: int32 [len(chunks)] ready flags; timeout_s, mailbox, code: the watchdog's (kernels/deadline_wait.py)."""

    def __init__(self, buf: torch.Tensor, src_offsets, dst_offsets, row_elems: int, programs: int, chunks,
                 words: torch.Tensor, ready_in, ready_out, pulled_out, flags: torch.Tensor, timeout_s: float,
                 mailbox: torch.Tensor, code: int):
        if programs < 1:
            raise ValueError(f"SignaledPull: programs={programs}: expected >= 1")
        peers = len(src_offsets)
        if not peers or any(len(x) != peers for x in (dst_offsets, ready_in, ready_out, pulled_out)):
            raise ValueError("SignaledPull: one destination offset and one word of each kind per peer, at least one "
                             "peer")
        if not chunks or flags.numel() < len(chunks):
            raise ValueError(f"SignaledPull: {len(chunks)} chunks and {flags.numel()} flags: at least one chunk, a "
                             f"flag per chunk")
        device = buf.device
        self.buf, self.row_elems, self.programs, self.peers = buf, row_elems, programs, peers
        # the alignment hint (16-byte vectors) only where every offset the kernel forms is a multiple of 16 elements
        aligned = all(o % 16 == 0 for o in (*src_offsets, *dst_offsets, row_elems)) and buf.data_ptr() % 16 == 0
        self.align = 16 if aligned else 1

        def table(values, dtype=torch.int64):
            return torch.tensor(list(values), dtype=dtype, device=device)
        self.src_offsets, self.dst_offsets = table(src_offsets), table(dst_offsets)
        self.chunks = table([x for chunk in chunks for x in chunk], torch.int32)
        self.num_chunks = len(chunks)
        self.ready_in, self.ready_out, self.pulled_out = table(ready_in), table(ready_out), table(pulled_out)
        self.counters = torch.zeros(self.num_chunks + 1, dtype=torch.int32, device=device)
        self.words, self.flags, self.mailbox = words, flags, mailbox
        self.timeout_s, self.code = float(timeout_s), code
        self._constexprs = dict(PEERS=peers, BLOCK=BLOCK, ALIGN=self.align, INTERPRETED=INTERPRET)
        self._kernel = None if INTERPRET else DirectKernel(self._jit(-1))   # compiled now, launching nothing
        self._args = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a
                           for a in self._arguments(self.num_chunks)) + tuple(self._constexprs.values())

    def _arguments(self, num_chunks: int):
        return (self.buf, self.src_offsets, self.dst_offsets, self.chunks, num_chunks, self.row_elems, self.words,
                self.ready_in, self.ready_out, self.pulled_out, self.counters, self.flags, self.timeout_s,
                self.mailbox, self.code)

    def _jit(self, num_chunks: int):
        return signaled_pull_kernel[(self.programs,)](*self._arguments(num_chunks), **self._constexprs,
                                                      num_warps=NUM_WARPS)

    def __call__(self, stream: int):
        """The call's pulls, flags and handshakes, launched on the raw stream `stream` (CPU: the interpreter's)."""
        if self._kernel is None:
            self._jit(self.num_chunks)
        else:
            self._kernel(self.programs, stream, *self._args)
