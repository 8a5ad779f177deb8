"""Run a function on N processes joined in one group: gloo on the CPU (the stand-in for a TP group in
CI), or NCCL with one GPU per process."""
import multiprocessing
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world_size, init_file, backend, fn, args, environ):
    # the caller's environment as it is now (a fork server's children inherit the server's, from its start)
    os.environ.clear()
    os.environ.update(environ)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        # Printed here, before anything that waits for the peers: a rank failing while its peer still runs
        # collectives would otherwise leave both hung (this rank in destroy_process_group, the peer in its next
        # exchange) and the failure's message unseen. Without the teardown, spawn's join raises this rank's error
        # and terminates the others.
        print(f"rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    # Every rank passed fn before any tears its group down: a rank that left while a peer was still connecting closed
    # the connection under it (seen in CI: "Gloo connectFullMesh failed ... Connection closed by peer" in a test
    # whose fn communicates nothing).
    dist.barrier()
    dist.destroy_process_group()
    # Passed: leave without the interpreter's teardown, where a native thread still joinable at exit
    # occasionally aborted a passing gloo worker ("terminate called without an active exception", CI).
    # os._exit also skips multiprocessing's exit handlers, which shut down the processes this worker
    # started (Megatron's checkpoint writer keeps a Manager server process for its results queue): end
    # them here, or they outlive the test (tests/conftest.py fails the session if they do).
    _end_children()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _end_children(timeout_s=10.0):
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout_s)
        if child.is_alive():
            child.kill()
            child.join()


# Modules a fork server imports once for every gloo rank after it (those missing here are skipped by the server).
FORK_SERVER_PRELOAD = ["torch", "torch.distributed", "megatron.core"]


def start_method(backend):
    """How run_distributed starts its ranks. Gloo ranks on a machine without CUDA fork from a server that imported
    torch and Megatron once (FORK_SERVER_PRELOAD): a spawned rank imports them again, 3-7 s per rank on CI's
    machines, which was most of CI's time. Elsewhere spawn: a process must not fork once CUDA may have been
    initialized in it, and the server's imports ask torch about CUDA only where it is absent. Nothing of overlap_tp
    is preloaded: its kernels read TRITON_INTERPRET when they are imported (tests/conftest.py sets it)."""
    if backend != "gloo" or torch.cuda.is_available():
        return "spawn"
    multiprocessing.set_forkserver_preload(FORK_SERVER_PRELOAD)   # read when the server starts (the first call)
    return "forkserver"


def fork_server_pid():
    """The fork server's pid while it runs (a helper of this process, as the resource tracker is), else None."""
    from multiprocessing import forkserver
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def run_distributed(world_size, fn, *args, backend="gloo"):
    """fn(rank, world_size, *args) on every rank; an exception on any rank fails the caller."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world_size, os.path.join(tmp, "init"), backend, fn, args, dict(os.environ)),
                           nprocs=world_size, join=True, start_method=start_method(backend))
