"""Test set-up shared by every test file.

Without a GPU the Triton kernels run in Triton's CPU interpreter; that must be decided before any
kernel module is imported (triton.jit reads TRITON_INTERPRET when it decorates). GPU tests carry the
`gpu` marker and are skipped where CUDA is absent.

No test may leave a process behind: the session records pytest's child processes at its start, makes
pytest the reaper of every orphaned descendant (tests/leftovers.py says why that is needed), and at
its end fails the run, naming them, if any process it did not start with is still alive (they are
then killed, so a CI machine does not accumulate them). Session hooks rather than a session fixture:
a fixture's teardown error would be reported against whichever test happened to run last.
"""
import multiprocessing.resource_tracker
import os

import pytest
import torch

import distributed
import leftovers

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_SESSION = {}


def pytest_sessionstart(session):
    _SESSION["reaper"] = leftovers.become_subreaper()
    _SESSION["before"] = set(leftovers.children())


def pytest_sessionfinish(session, exitstatus):
    if "before" not in _SESSION:
        return
    # multiprocessing's resource tracker and fork server are pytest's own helpers (started by the first
    # run_distributed; they end with pytest), not something a test left behind
    tracker = getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)
    left = leftovers.leftovers(_SESSION["before"], exclude={tracker, distributed.fork_server_pid()})
    if not left:
        return
    lines = [leftovers.describe(p) for p in left]
    if not _SESSION["reaper"]:
        lines.append("(no child subreaper here: orphans re-parented to init were not counted)")
    leftovers.end(left)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    title = f"{len(left)} process(es) outlived the tests (killed now)"
    if reporter is not None:
        reporter.write_sep("=", title, red=True)
        for line in lines:
            reporter.write_line(line, red=True)
    else:
        print("\n".join([title] + lines))
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
