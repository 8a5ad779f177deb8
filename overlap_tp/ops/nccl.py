"""A raw NCCL communicator, called through ctypes, for the overlapped ops' per-group collectives.

Why not torch.distributed for these: one `dist.reduce_scatter_tensor` call costs about as much host time
(work objects, events, `record_param_comms`) as a mid-size reduce-scatter takes on the GPU, and a signaled
GEMM issues one collective per group behind the GEMM launch, so through torch.distributed the host would set
the pace (docs/performance.md). ncclReduceScatter itself costs a few microseconds to enqueue. The
collectives are still NCCL's (communication agnosticism); only the Python/C++ wrapper is skipped.

The communicator is created over the ranks of a torch process group (the unique id travels through
that group) with `maxCTAs` set, which is how the collective is confined to the SMs the GEMM leaves.
It uses the libnccl that torch already loaded, so it is the same NCCL version as torch's own.
"""
import ctypes
import os

import torch
import torch.distributed as dist

NCCL_SUM = 0
NCCL_DTYPES = {torch.uint8: 1, torch.float16: 6, torch.float32: 7, torch.bfloat16: 9}   # uint8: FP8 rows as bytes
CONFIG_UNDEF_INT = -(2 ** 31)
CONFIG_MAGIC = 0xCAFEBEEF
CONFIG_LAYOUT_VERSION = 22800       # the field list below is ncclConfig_v22800 (nccl.h of NCCL 2.28)


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


class Config(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int), ("cgaClusterSize", ctypes.c_int), ("minCTAs", ctypes.c_int),
                ("maxCTAs", ctypes.c_int), ("netName", ctypes.c_char_p), ("splitShare", ctypes.c_int),
                ("trafficClass", ctypes.c_int), ("commName", ctypes.c_char_p), ("collnetEnable", ctypes.c_int),
                ("CTAPolicy", ctypes.c_int), ("shrinkShare", ctypes.c_int), ("nvlsCTAs", ctypes.c_int),
                ("nChannelsPerNetPeer", ctypes.c_int), ("nvlinkCentricSched", ctypes.c_int)]


_lib = None


def library():
    """libnccl.so.2: the copy torch loaded (dlopen by soname returns it), else the nvidia-nccl wheel's."""
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL("libnccl.so.2")
        except OSError:
            import nvidia.nccl
            lib = ctypes.CDLL(os.path.join(os.path.dirname(nvidia.nccl.__file__), "lib", "libnccl.so.2"))
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclCommInitRankConfig.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int,
                                               ctypes.POINTER(Config)]
        collective = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                      ctypes.c_void_p]
        lib.ncclReduceScatter.argtypes = collective
        lib.ncclAllReduce.argtypes = collective
        lib.ncclBroadcast.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_void_p]
        point_to_point = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.ncclSend.argtypes = point_to_point
        lib.ncclRecv.argtypes = point_to_point
        _lib = lib
    return _lib


def _check(result, what):
    if result != 0:
        raise RuntimeError(f"overlap_tp: {what} failed: {library().ncclGetErrorString(result).decode()}")


def gather_spans(world: int, rows: int, cols: int, elem_bytes: int, lo: int, hi: int):
    """Where rows [lo, hi) of every root's region of a gathered [world * rows, cols] buffer lie, as (byte offset from
    the buffer, elements) per root: what all_gather_rows_at broadcasts."""
    row_bytes = cols * elem_bytes
    return tuple(((root * rows + lo) * row_bytes, (hi - lo) * cols) for root in range(world))


class Communicator:
    """NCCL over the ranks of `group`, at most `max_ctas` CTAs per collective (0: NCCL's default)."""

    def __init__(self, group, device: torch.device, max_ctas: int):
        lib = library()
        uid = UniqueId()
        if dist.get_rank(group) == 0:
            _check(lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        raw = torch.frombuffer(bytearray(bytes(uid)), dtype=torch.uint8).to(device)
        dist.broadcast(raw, src=dist.get_global_rank(group, 0), group=group)
        ctypes.memmove(ctypes.byref(uid), bytes(raw.cpu().tolist()), 128)
        config = Config(ctypes.sizeof(Config), CONFIG_MAGIC, CONFIG_LAYOUT_VERSION, *([CONFIG_UNDEF_INT] * 4), None,
                        CONFIG_UNDEF_INT, CONFIG_UNDEF_INT, None, *([CONFIG_UNDEF_INT] * 6))
        if max_ctas:
            config.maxCTAs = max_ctas
        # No thread-block clusters: NCCL's default on Hopper launches clusters of CTAs, which must be
        # co-scheduled within one GPC. Next to a persistent GEMM that holds all but `max_ctas` SMs, the
        # free SMs are scattered over GPCs and a cluster may never fit; an AllGather+GEMM whose CTAs
        # spin on the broadcast's ready flags then hangs.
        config.cgaClusterSize = 1
        self.comm = ctypes.c_void_p()
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.device_index = device.index
        self._peers_connected = False
        self._reduce_scatter, self._all_reduce = lib.ncclReduceScatter, lib.ncclAllReduce
        with torch.cuda.device(device):
            _check(lib.ncclCommInitRankConfig(ctypes.byref(self.comm), dist.get_world_size(group), uid,
                                              dist.get_rank(group), ctypes.byref(config)), "ncclCommInitRankConfig")

    def connect_peers(self):
        """Make NCCL's send/receive connections to every peer now, with one element each way and a wait, once per
        communicator; every rank of the group calls it at the same point (its first MoE exchange). NCCL connects a
        peer pair at its first send/receive, and that setup waits for the device: at the first signaled dispatch,
        beside a persistent GEMM whose tiles spin until the exchange raises their flags, it can never return (the
        first signaled dispatch would hang in ncclGroupEnd)."""
        if self._peers_connected:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("overlap_tp: the first MoE exchange of a communicator was captured into a CUDA graph; "
                               "NCCL's peer connections are made (with a wait) at the first exchange: run one step "
                               "eagerly before capture (Megatron's warmup iterations do)")
        peers = [p for p in range(self.world) if p != self.rank]
        sent = torch.zeros(self.world, dtype=torch.float32, device=torch.device("cuda", self.device_index))
        received = torch.empty_like(sent)
        self.exchange([(p, sent[p:p + 1]) for p in peers], [(p, received[p:p + 1]) for p in peers])
        torch.cuda.current_stream(self.device_index).synchronize()
        self._peers_connected = True

    def _stream(self, stream):
        """`stream` (a raw handle), or the current stream's, without building a torch.cuda.Stream (a signaled
        call issues one collective per group, on the host's hot path)."""
        return torch._C._cuda_getCurrentRawStream(self.device_index) if stream is None else stream

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, stream=None):
        """On `stream` (default: the current one): out = this rank's block of the sum over ranks of inp."""
        _check(library().ncclReduceScatter(inp.data_ptr(), out.data_ptr(), out.numel(), NCCL_DTYPES[out.dtype],
                                           NCCL_SUM, self.comm, self._stream(stream)), "ncclReduceScatter")

    def all_reduce(self, x: torch.Tensor, stream=None):
        """On `stream` (default: the current one): x = sum over ranks of x, in place."""
        _check(library().ncclAllReduce(x.data_ptr(), x.data_ptr(), x.numel(), NCCL_DTYPES[x.dtype], NCCL_SUM,
                                       self.comm, self._stream(stream)), "ncclAllReduce")

    def reduce_scatter_at(self, dst: int, src: int, count: int, dtype: torch.dtype, stream: int):
        """reduce_scatter on device addresses: `count` elements of this rank's block at dst, from t * count at src
        (the signaled ops' per-group collectives: offsets made once per plan, no tensor view per call)."""
        _check(self._reduce_scatter(src, dst, count, NCCL_DTYPES[dtype], NCCL_SUM, self.comm, stream),
               "ncclReduceScatter")

    def all_reduce_at(self, dst: int, src: int, count: int, dtype: torch.dtype, stream: int):
        """all_reduce on device addresses: dst = sum over ranks of `count` elements at src (in place: src == dst)."""
        _check(self._all_reduce(src, dst, count, NCCL_DTYPES[dtype], NCCL_SUM, self.comm, stream), "ncclAllReduce")

    def all_gather_rows(self, gathered: torch.Tensor, src: torch.Tensor, lo: int, hi: int, stream=None):
        """On `stream` (default: the current one): rows [lo, hi) of every rank's shard into the same rows of
        that rank's region of `gathered` [t * rows, K], in place (one broadcast per root in one NCCL group
        call), so the rows land in the standard order with no staging copy. This rank's own rows are expected
        to be in `gathered` already (in-place broadcast); `src` is checked to be this rank's shard shape."""
        rows, cols = gathered.shape[0] // self.world, gathered.shape[1]
        assert src.shape == (rows, cols), (src.shape, (rows, cols))
        self.all_gather_rows_at(gathered.data_ptr(), gather_spans(self.world, rows, cols, gathered.element_size(),
                                                                  lo, hi), gathered.dtype, self._stream(stream))

    def all_gather_rows_at(self, base: int, spans, dtype: torch.dtype, stream: int):
        """all_gather_rows on device addresses: spans[root] = (byte offset from `base`, elements) of root's rows of
        the gathered buffer, broadcast in place from root, one NCCL group call (AgGemm's chunks: the spans are made
        once per plan, no region or row view per call).

        NCCL runs a group's broadcasts one after the other (on its SHM transport each takes about as long as
        Megatron's AllGather of twice the rows). Broadcasts stay because the two alternatives measured slower on
        the mid-size layer at the cross-node proxy: sends and receives per peer in one group call, and one
        in-place ncclAllGather per chunk into a chunk-major buffer that the GEMM's tiles read where the rows lie
        (docs/performance.md)."""
        lib, nccl_dtype = library(), NCCL_DTYPES[dtype]
        _check(lib.ncclGroupStart(), "ncclGroupStart")
        for root, (offset, count) in enumerate(spans):
            _check(lib.ncclBroadcast(base + offset, base + offset, count, nccl_dtype, root, self.comm, stream),
                   "ncclBroadcast")
        _check(lib.ncclGroupEnd(), "ncclGroupEnd")

    def exchange(self, sends, recvs, stream=None):
        """On `stream` (default: the current one): send every (peer, tensor) of `sends` and receive every
        (peer, tensor) of `recvs` in place, in one NCCL group call (the MoE all-to-all of one group of rows;
        peers are ranks of the group, tensors contiguous)."""
        lib, stream = library(), self._stream(stream)
        _check(lib.ncclGroupStart(), "ncclGroupStart")
        for peer, x in sends:
            _check(lib.ncclSend(x.data_ptr(), x.numel(), NCCL_DTYPES[x.dtype], peer, self.comm, stream), "ncclSend")
        for peer, x in recvs:
            _check(lib.ncclRecv(x.data_ptr(), x.numel(), NCCL_DTYPES[x.dtype], peer, self.comm, stream), "ncclRecv")
        _check(lib.ncclGroupEnd(), "ncclGroupEnd")
