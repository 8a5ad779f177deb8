"""A compiled Triton kernel launched through its C launcher, with nothing in between.

Triton's launch path costs host time that a plan's launches do not need (docs/performance.md): the JIT binds and
specializes every argument (SignaledGemm and the other launchers here skip that by keeping the compiled kernel),
and `CompiledKernel.run` then still goes through Python per launch: scratch-allocation closures, a loop over the
arguments that re-encodes every TMA descriptor (`TensorDescriptor` -> `CUtensorMap`, a driver call), and in the C
launcher one `data_ptr()` call plus one `cuPointerGetAttribute` per tensor argument. `DirectKernel` calls the C
launcher itself:

    kernel = DirectKernel(compiled)                       # once: the launcher, the function, the TMA metadata
    kernel(grid, stream, *kernel.tma(0, a), ptr, n, ...)  # per launch: pointers as ints, descriptors cached

    launch = JitLauncher(some_kernel)                     # a @triton.jit kernel without tensor descriptors:
    launch[grid](*args, **kwargs)                         # as some_kernel[grid](...), through DirectKernels

Arguments are the kernel's in parameter order, constexprs included (the launcher skips them), with each tensor
passed as its `data_ptr()` and each tensor-descriptor parameter expanded by `tma(i, tensor)` into the launcher's
(CUtensorMap, shape..., strides...). Descriptors are cached by (parameter, address, shape, strides): what a
CUtensorMap encodes beyond the kernel's fixed dtype, box and swizzle, so a cached one is the one Triton would
encode. Weights hit every launch; activations hit when the allocator hands back the same block.

This knows the layout of Triton 3.6's NVIDIA launcher (the device's; `DIRECT_LAYOUT`). Elsewhere, or for a kernel
that needs a global scratch buffer, it launches through `CompiledKernel.run` with `TensorDescriptor`s (the same
kernel and arguments, more host time) and warns once, naming the reason.
"""
import os
import warnings

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

# Under the CPU interpreter there are no compiled kernels: every launch goes through the JIT.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DIRECT_LAYOUT = "iiiKKppOOOOOO"   # Triton 3.6's C launcher: grid, stream, function, cluster flags, scratch, metadata
MAX_CACHED_DESCRIPTORS = 64       # per kernel: a plan's weights and its activations' few addresses
_warned = set()


def _c_launcher(run):
    """The C launch function behind a CudaLauncher (3.6 wraps it in a closure when the kernel has tensor
    descriptors), or a reason why there is none we know how to call."""
    try:
        from triton.backends.nvidia import driver as nvidia_driver
    except ImportError:
        return None, "Triton has no NVIDIA backend"
    if getattr(nvidia_driver, "_BASE_ARGS_FORMAT", None) != DIRECT_LAYOUT:
        return None, f"Triton {triton.__version__}'s launcher arguments are not 3.6's"
    launch = getattr(run, "launch", None)
    if launch is None:
        return None, f"Triton {triton.__version__}'s launcher has no launch function"
    if getattr(launch, "__closure__", None):   # wrap_handle_tensordesc's inner(*args): its `launcher` cell
        cells = dict(zip(launch.__code__.co_freevars, launch.__closure__))
        if "launcher" not in cells:
            return None, f"Triton {triton.__version__}'s tensor-descriptor wrapper is not 3.6's"
        launch = cells["launcher"].cell_contents
    if getattr(run, "global_scratch_size", 0) or getattr(run, "profile_scratch_size", 0):
        return None, "the kernel needs a scratch buffer per launch"
    return launch, None


class DirectKernel:
    """One compiled kernel (a `CompiledKernel` from the JIT), launched directly; see the module doc."""

    def __init__(self, compiled):
        run = compiled.run   # creates the launcher and loads the module
        self.compiled, self.function, self.packed = compiled, compiled.function, compiled.packed_metadata
        self._tma_meta = getattr(compiled.metadata, "tensordesc_meta", None) or []
        self._launch, reason = _c_launcher(run)
        descriptors = sum(isinstance(s, str) and s.startswith("tensordesc") for s in compiled.src.signature.values())
        if self._launch is not None and descriptors != len(self._tma_meta):
            self._launch, reason = None, "its tensor descriptors were lowered without TMA"
        if self._launch is not None and any(m.get("fp4_padded") for m in self._tma_meta):
            self._launch, reason = None, "an fp4-padded tensor descriptor"
        self.direct = self._launch is not None
        if self.direct:
            from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
            self._fill = triton.runtime.driver.active.utils.fill_tma_descriptor
            self._dtype_to_host = TMA_DTYPE_DEVICE_TO_HOST
            self._flags = (run.launch_cooperative_grid, run.launch_pdl)
        else:
            message = (f"overlap_tp: {compiled.name} launches through Triton's CompiledKernel.run ({reason}); "
                       f"the same kernel, with more host time per launch")
            if message not in _warned:
                _warned.add(message)
                warnings.warn(message, stacklevel=3)
        self._descriptors = {}

    def tma(self, index: int, tensor: torch.Tensor, block_shape, view=None) -> tuple:
        """The launcher's arguments for the kernel's `index`-th tensor-descriptor parameter: a descriptor over
        `tensor`, or over `view(tensor)` (a function of the tensor alone, e.g. the 2-D matrix a stacked weight is
        read as: computed on a cache miss only), with the box `block_shape` the kernel was compiled for (the
        CUtensorMap takes the compiled box from the kernel's metadata, which may split it)."""
        if not self.direct:
            return (TensorDescriptor.from_tensor(tensor if view is None else view(tensor), block_shape),)
        key = (index, tensor.data_ptr(), tensor.shape, tensor.stride())
        args = self._descriptors.get(key)
        if args is None:
            meta = self._tma_meta[index]
            described = tensor if view is None else view(tensor)
            TensorDescriptor.from_tensor(described, block_shape)   # Triton's own checks, once per key
            shape, strides = list(described.shape), list(described.stride())
            tensor_map = self._fill(described.data_ptr(), meta["swizzle"], meta["elem_size"],
                                    self._dtype_to_host[meta["elem_type"]], meta["block_size"], shape, strides, 0)
            args = (tensor_map, *shape, *strides)
            if len(self._descriptors) >= MAX_CACHED_DESCRIPTORS:
                self._descriptors.clear()
            self._descriptors[key] = args
        return args

    def __call__(self, grid, stream: int, *args):
        """Launch `grid` programs (an int, or a tuple of up to 3) on the raw stream handle `stream`."""
        x, y, z = (grid, 1, 1) if type(grid) is int else (tuple(grid) + (1, 1))[:3]
        if self.direct:
            self._launch(x, y, z, stream, self.function, *self._flags, None, None, self.packed, None, None, None, *args)
        else:
            self.compiled.run(x, y, z, stream, self.function, self.packed, None, None, None, *args)


class JitLauncher:
    """`launcher[grid](*args, **kwargs)` runs what `fn[grid](*args, **kwargs)` runs, the compiled kernel launched
    as a DirectKernel: Triton's own binder specializes the arguments (its key: the same compiled kernel the JIT would
    pick), the JIT compiles and launches each new specialization once, later launches skip its cache-key string, its
    launch wrapper and the launcher's pointer look-ups (tensors go as `data_ptr()`). For kernels without
    tensor-descriptor parameters (SignaledGemm has its own launcher); under the CPU interpreter, the JIT."""

    def __init__(self, fn):
        self.fn = fn
        self._kernels = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args, kwargs):
        if INTERPRET:
            self.fn[grid](*args, **kwargs)
            return
        device = torch._C._cuda_getDevice()
        params, specialization, options = self.fn.device_caches[device][-1](*args, **kwargs)
        key = (device, tuple(specialization), tuple(options.items()))
        kernel = self._kernels.get(key)
        if kernel is None:
            self._kernels[key] = DirectKernel(self.fn[grid](*args, **kwargs))
            return
        kernel(grid, torch._C._cuda_getCurrentRawStream(device),
               *[v.data_ptr() if isinstance(v, torch.Tensor) else v for v in params.values()])
