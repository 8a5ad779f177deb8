"""Processes a test run leaves behind: found, reported and ended by the session check in conftest.py.

A test's worker that ends with os._exit (tests/distributed.py) skips multiprocessing's exit handlers,
so a process it started (Megatron's checkpoint writer starts a multiprocessing Manager server) is not
shut down and, once its parent is gone, is re-parented to init: not a child of pytest, invisible to a
count of pytest's children. The session therefore makes pytest a child subreaper (Linux
PR_SET_CHILD_SUBREAPER): every orphaned descendant is re-parented to pytest instead, so "pytest's
children at the end minus those at the start" is exactly what the tests left running.
"""
import ctypes
import os
import signal
import time

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux); False where not supported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _stat(pid):
    """(state, ppid) of a process from /proc, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()   # the command name may hold spaces and parentheses
    return fields[0], int(fields[1])


def children(pid=None):
    """{pid: state} of the live processes whose parent is `pid` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None and stat[1] == pid:
                out[int(name)] = stat[0]
    return out


def describe(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = "?"
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next((line.split(":", 1)[1].strip() for line in f if line.startswith("VmRSS")), "?")
    except OSError:
        rss = "?"
    return f"pid {pid} (rss {rss}): {cmd[:200]}"


def reap_zombies():
    """Collect this process's exited children (orphans re-parented to a subreaper stay zombies until then)."""
    for pid, state in children().items():
        if state == "Z":
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def leftovers(before, exclude=(), grace_s=10.0):
    """This process's live children not in `before` nor `exclude`, after giving them `grace_s` to exit."""
    deadline = time.monotonic() + grace_s
    while True:
        reap_zombies()
        left = sorted(pid for pid, state in children().items()
                      if state != "Z" and pid not in before and pid not in exclude)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def end(pids):
    """SIGKILL `pids` and their descendants (children first found, then killed, then reaped)."""
    family = list(pids)
    for pid in pids:
        family += _descendants(pid)
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(0.2)
    reap_zombies()


def _descendants(pid):
    out = []
    for child in children(pid):
        out += [child] + _descendants(child)
    return out
