"""A process that a rank starts through multiprocessing (Megatron's torch_dist checkpointing starts a Manager
server) ends when the rank dies, with launch/orphans.py's end_with_spawning_rank called at the main module's
import (as launch/pretrain.py does); without it the process outlives the rank (the control, so the test can
fail)."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from leftovers import _stat

MAIN = textwrap.dedent("""
    import multiprocessing, os, signal
    if os.environ.get("END_WITH_PARENT") == "1":
        from overlap_tp.launch.orphans import end_with_spawning_rank
        assert end_with_spawning_rank() == (__name__ == "__mp_main__")   # as launch/pretrain.py calls it
    if __name__ == "__main__":
        manager = multiprocessing.get_context("spawn").Manager()   # what torch_dist checkpointing starts
        print(manager._process.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)                       # the rank dies, as under a fault
""")


def _alive(pid):
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def _orphaned_manager(tmp_path, hooked):
    script = tmp_path / "rank.py"
    script.write_text(MAIN)
    env = dict(os.environ, END_WITH_PARENT="1" if hooked else "0")
    rank = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env, text=True)
    manager = int(rank.stdout.readline())   # not read to EOF: the orphan may hold the pipe (the bug itself)
    assert rank.wait(timeout=60) == -signal.SIGKILL
    rank.stdout.close()
    return manager


def test_a_spawned_helper_ends_with_its_rank(tmp_path):
    manager = _orphaned_manager(tmp_path, hooked=True)
    deadline = time.monotonic() + 10   # the watch polls every second
    while _alive(manager) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(manager), "the Manager outlived its parent by 10 s"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_without_the_watch_the_helper_outlives_its_rank(tmp_path):
    manager = _orphaned_manager(tmp_path, hooked=False)
    try:
        time.sleep(2)
        assert _alive(manager), "control: the Manager ended by itself (the test above would prove nothing)"
    finally:
        os.kill(manager, signal.SIGKILL)
