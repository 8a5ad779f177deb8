"""The session's leftover-process check (tests/conftest.py, tests/leftovers.py) sees what it must: a
process orphaned by its parent is re-parented to pytest, counted, and ended."""
import subprocess
import sys
import time

import pytest

import leftovers

# the grandchild must not hold the pipe run() reads to its end
ORPHAN_MAKER = ("import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
                "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)")


def test_an_orphaned_grandchild_is_counted_and_ended():
    if not leftovers.become_subreaper():
        pytest.skip("no PR_SET_CHILD_SUBREAPER here (not Linux)")
    before = set(leftovers.children())
    orphan = int(subprocess.run([sys.executable, "-c", ORPHAN_MAKER], capture_output=True, text=True,
                                check=True).stdout)
    try:
        assert leftovers.leftovers(before, grace_s=0.5) == [orphan]   # its parent exited: now pytest's child
        assert "time.sleep(120)" in leftovers.describe(orphan)
    finally:
        leftovers.end([orphan])
    deadline = time.monotonic() + 5
    while orphan in leftovers.children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert orphan not in leftovers.children()
    assert leftovers.leftovers(before, grace_s=0) == []
