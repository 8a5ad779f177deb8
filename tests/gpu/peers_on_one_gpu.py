"""Two ranks on ONE GPU for the p2p transports (a test harness, not a way to train).

The p2p transports (overlap_tp/ops/p2p_*.py, sync.py) need only peer-mapped memory and stream memory operations on
it. PyTorch's symmetric memory refuses two ranks on one device, and NCCL refuses them too, but CUDA IPC maps one
process's allocation into another process on the same GPU. `install()` replaces `symmetric_memory.empty` and
`rendezvous` in this process with that: the buffer is an ordinary allocation, rendezvous exchanges IPC handles
over the (gloo) group and maps the peers' allocations. What runs on top is the ops' own code, unchanged: their
plans, signals, waits, copies, kernels and graphs; so a one-GPU machine checks the t = 2 protocols' results
(bits, replays, no hang), not their speed: the two processes' contexts time-slice the GPU.
"""
import ctypes

import torch
import torch.distributed as dist

_IPC_LAZY_ENABLE_PEER_ACCESS = 0x1


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


_driver = None
_opened = {}   # IPC handle bytes -> the base address it is mapped at in this process


def _cuda():
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_uint64]
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                                ctypes.c_uint64]
        _driver = lib
    return _driver


def _check(result, what):
    if result != 0:
        raise RuntimeError(f"peers_on_one_gpu: {what} failed with CUresult {result}")


def _as_tensor(address: int, nbytes: int, dtype, shape):
    class Raw:
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}
    return torch.as_tensor(Raw(), device="cuda").view(dtype).view(shape)


class Handle:
    """What the ops use of a symmetric-memory handle: every rank's address of the buffer, a peer's buffer as a
    tensor, and a barrier of the group."""

    def __init__(self, tensor: torch.Tensor, group):
        lib = _cuda()
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), tensor.data_ptr()),
               "cuMemGetAddressRange")
        handle = _IpcHandle()
        _check(lib.cuIpcGetMemHandle(ctypes.byref(handle), base.value), "cuIpcGetMemHandle")
        mine = (ctypes.string_at(ctypes.addressof(handle), 64), tensor.data_ptr() - base.value)   # all 64 bytes
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        rank = dist.get_rank(group)
        self.group, self.buffer_ptrs = group, []
        for r, (raw, offset) in enumerate(everyone):
            if r == rank:
                self.buffer_ptrs.append(tensor.data_ptr())
                continue
            if raw not in _opened:
                peer = _IpcHandle()
                ctypes.memmove(ctypes.byref(peer), raw, 64)
                mapped = ctypes.c_uint64()
                _check(lib.cuIpcOpenMemHandle_v2(ctypes.byref(mapped), peer, _IPC_LAZY_ENABLE_PEER_ACCESS),
                       "cuIpcOpenMemHandle")
                _opened[raw] = mapped.value
            self.buffer_ptrs.append(_opened[raw] + offset)

    def get_buffer(self, rank: int, shape, dtype, storage_offset: int = 0) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        size = torch.empty((), dtype=dtype).element_size()
        return _as_tensor(self.buffer_ptrs[rank] + storage_offset * size, numel * size, dtype, tuple(shape))

    def barrier(self, channel: int = 0):
        torch.cuda.synchronize()
        dist.barrier(group=self.group)
        torch.cuda.synchronize()


def _empty(*size, dtype=None, device=None):
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    return torch.empty(size, dtype=dtype, device=device)


def install():
    """This process's symmetric memory becomes CUDA IPC (call in every rank before building a p2p plan)."""
    from torch.distributed import _symmetric_memory as symm_mem
    symm_mem.empty = _empty
    symm_mem.rendezvous = lambda tensor, group: Handle(tensor, group)
