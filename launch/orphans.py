"""Helper processes that end with the training rank that started them.

torchrun ends a failed job by signalling its ranks. What a rank started itself through multiprocessing is not a
worker of torchrun's and outlives it: Megatron's torch_dist checkpointing starts a multiprocessing Manager (a
server process, for its write results), which then holds the job's stdout and its memory: after a rank is
SIGKILLed, a torch_dist run piped into `tee` would go on until something killed the Manager, where the legacy
format, which starts no Manager, ends in seconds, and processes of such a job can outlive torchrun's exit. The
test suite checks for the same leftovers (tests/leftovers.py).

A process started with multiprocessing's spawn (or forkserver) method first imports its parent's main module
(multiprocessing marks that moment: current_process()._inheriting), then runs its target. The training
launcher (launch/pretrain.py, whichever way it is started) calls `end_with_spawning_rank()` at import: in such a
child a daemon thread ends the process once the parent that spawned it is gone (the child was re-parented:
os.getppid() changed). Not prctl(PR_SET_PDEATHSIG): that signal follows the thread that started the child,
and would end a Manager started from a short-lived thread while its rank still runs. Not covered: children of
a script that launch/run.py runs as `__main__` (they import that script, not overlap_tp).
"""
import multiprocessing
import os
import sys
import threading
import time

__all__ = ["end_with_parent", "end_with_spawning_rank"]


def end_with_parent(period_s: float = 1.0):
    """Watch this process's parent every `period_s` seconds from a daemon thread; once it is gone, exit
    (status 1, one line on stderr). For a multiprocessing child (see above): its parent is the rank."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(period_s)
        sys.stderr.write(f"overlap_tp: process {os.getpid()} ({multiprocessing.current_process().name}) ends: its "
                         f"parent {parent} is gone\n")
        sys.stderr.flush()
        os._exit(1)

    threading.Thread(target=watch, name="overlap_tp-end-with-parent", daemon=True).start()


def end_with_spawning_rank() -> bool:
    """end_with_parent() where this process is a multiprocessing child importing its parent's main module (the
    flag is multiprocessing's own, private, hence read defensively); elsewhere nothing. Returns which."""
    if not getattr(multiprocessing.current_process(), "_inheriting", False):
        return False
    end_with_parent()
    return True
