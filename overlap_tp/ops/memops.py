"""CUDA stream memory operations and events through the driver library (libcuda), called with ctypes.

The comm stream waits on a tile counter or a peer's ready word without spending an SM (cuStreamWaitValue32:
the stream's front end polls the word) and raises ready words (cuStreamWriteValue32). Both, and the events
that fork the comm stream from the caller's stream and join it back, are captured into CUDA graphs as
memory-operation and event nodes. ctypes on the driver costs about a microsecond per call, several times less
than the Python wrappers (cuda-bindings objects, torch.cuda.Event, `with torch.cuda.stream`). Streams are raw
handles (`torch.cuda.Stream.cuda_stream`,
`torch._C._cuda_getCurrentRawStream`), words are device addresses (local, or a peer's mapped through
symmetric memory).
"""
import ctypes

CU_STREAM_WAIT_VALUE_GEQ = 0x0
CU_STREAM_WAIT_VALUE_EQ = 0x1
# The default write flag puts a memory fence before the write (__threadfence_system semantics, scoped to the
# stream): whoever observes the value also observes everything the stream wrote before it.
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0
CU_EVENT_DISABLE_TIMING = 0x2
CU_STREAM_MEM_OP_WAIT_VALUE_32 = 1
CU_STREAM_MEM_OP_WRITE_VALUE_32 = 2

_lib = None


def _driver():
    """libcuda with the prototypes used here; the stream memory operations by their _v2 names (the
    versions available on every platform without the NVreg_EnableStreamMemOPs module option)."""
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        ptr, u32, uint = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint
        for name in ("cuStreamWaitValue32_v2", "cuStreamWriteValue32_v2"):
            getattr(lib, name).argtypes = [ptr, ctypes.c_uint64, u32, uint]
            getattr(lib, name).restype = ctypes.c_int
        lib.cuStreamBatchMemOp_v2.argtypes = [ptr, uint, ptr, uint]
        lib.cuStreamBatchMemOp_v2.restype = ctypes.c_int
        lib.cuEventCreate.argtypes = [ctypes.POINTER(ptr), uint]
        lib.cuEventRecord.argtypes = [ptr, ptr]
        lib.cuStreamWaitEvent.argtypes = [ptr, ptr, uint]
        lib.cuEventQuery.argtypes = [ptr]
        lib.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ptr]
        lib.cuThreadExchangeStreamCaptureMode.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _lib = lib
    return _lib


def _check(result: int, what: str):
    if result != 0:
        _fail(result, what)


def _fail(result: int, what: str):
    text = ctypes.c_char_p()
    _driver().cuGetErrorString(result, ctypes.byref(text))
    raise RuntimeError(f"overlap_tp: {what} failed: {text.value.decode() if text.value else result}")


def wait_value(stream: int, address: int, value: int, equal: bool = False):
    """The stream waits until the word at `address` is >= value (cyclically: (int32)(*addr - value) >= 0),
    or == value with `equal`."""
    _check(_driver().cuStreamWaitValue32_v2(stream, address, value & 0xFFFFFFFF,
                                            CU_STREAM_WAIT_VALUE_EQ if equal else CU_STREAM_WAIT_VALUE_GEQ),
           "cuStreamWaitValue32")


def write_value(stream: int, address: int, value: int):
    """The stream writes `value` to the word at `address` after all its prior work, fenced."""
    result = _driver().cuStreamWriteValue32_v2(stream, address, value & 0xFFFFFFFF, CU_STREAM_WRITE_VALUE_DEFAULT)
    if result:
        _fail(result, "cuStreamWriteValue32")


class _MemOpParams(ctypes.Structure):
    """CUstreamBatchMemOpParams (cuda.h): a 48-byte union whose wait-value and write-value members share this
    layout (operation, address, value as a 64-bit union, flags, a driver-internal alias)."""
    _fields_ = [("operation", ctypes.c_uint32), ("address", ctypes.c_uint64), ("value", ctypes.c_uint64),
                ("flags", ctypes.c_uint32), ("alias", ctypes.c_uint64), ("pad", ctypes.c_uint64)]


assert ctypes.sizeof(_MemOpParams) == 48


class MemOps:
    """A fixed sequence of stream memory operations on fixed words, enqueued in order with one driver call
    (cuStreamBatchMemOp) instead of one call each: built once per plan, where the words live as long as the
    plan does. ops: ("wait", address, value) waits until the word is >= value (cyclically, as wait_value),
    ("write", address, value) writes it after all prior work, fenced (as write_value)."""

    def __init__(self, ops):
        self.count = len(ops)
        self._params = (_MemOpParams * max(1, self.count))()
        for params, (kind, address, value) in zip(self._params, ops):
            if kind == "wait":
                params.operation, params.flags = CU_STREAM_MEM_OP_WAIT_VALUE_32, CU_STREAM_WAIT_VALUE_GEQ
            elif kind == "write":
                params.operation, params.flags = CU_STREAM_MEM_OP_WRITE_VALUE_32, CU_STREAM_WRITE_VALUE_DEFAULT
            else:
                raise ValueError(f"MemOps: unknown operation {kind!r} (expected 'wait' or 'write')")
            params.address, params.value = address, value & 0xFFFFFFFF
        self._address = ctypes.addressof(self._params)
        self._batch = None   # the driver's entry point, looked up at the first issue (plans on CPUs never issue)

    def issue(self, stream: int):
        if self.count:
            if self._batch is None:
                self._batch = _driver().cuStreamBatchMemOp_v2
            result = self._batch(stream, self.count, self._address, 0)
            if result:
                _fail(result, "cuStreamBatchMemOp")


class Event:
    """A driver event without timing, reused for every fork or join (an event's record and wait take effect
    in stream order at enqueue time, so reuse needs no synchronisation)."""

    def __init__(self):
        lib = _driver()
        handle = ctypes.c_void_p()
        _check(lib.cuEventCreate(ctypes.byref(handle), CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        self.handle = handle.value
        # the entry points looked up once: every fork and join of an op's call records and waits on an event
        self._record, self._wait = lib.cuEventRecord, lib.cuStreamWaitEvent

    def record(self, stream: int):
        result = self._record(self.handle, stream)
        if result:
            _fail(result, "cuEventRecord")

    def wait(self, stream: int):
        """`stream` waits for the work recorded before the last record()."""
        result = self._wait(stream, self.handle, 0)
        if result:
            _fail(result, "cuStreamWaitEvent")

    def fence(self, waiter: int, producer: int):
        """`waiter` waits for everything enqueued on `producer` so far: record on producer, wait on waiter."""
        result = self._record(self.handle, producer) or self._wait(waiter, self.handle, 0)
        if result:
            _fail(result, "cuEventRecord / cuStreamWaitEvent")


def copy(stream: int, dst: int, src: int, nbytes: int):
    """An asynchronous copy of `nbytes` between device addresses (a peer's, mapped through symmetric memory,
    too: the copy engines move it, no SM)."""
    if nbytes:
        result = _driver().cuMemcpyAsync(dst, src, nbytes, stream)
        if result:
            _fail(result, "cuMemcpyAsync")


def stream_waits_for(waiter: int, producer: int, event: Event):
    """`waiter` waits for everything enqueued on `producer` so far (a fork or a join, also under capture)."""
    event.fence(waiter, producer)
