"""The watchdog's host side for waits inside CUDA graphs (the device side, a wait kernel with a deadline, is
tested in tests/gpu): mailbox records, the table of registered waits, and the thread that turns a record
into a message and exit code 70."""
import os
import subprocess
import sys
import textwrap

import pytest

from overlap_tp.ops import watchdog


def _record(code, seen):
    """What kernels/deadline_wait.py writes: (code << 32) | uint32(seen), as an int64."""
    value = (code << 32) | (seen & 0xFFFFFFFF)
    return value - (1 << 64) if value >= 1 << 63 else value


def test_records_decode_to_the_code_and_the_value_seen():
    assert watchdog.decode(_record(5, 0)) == (5, 0)
    assert watchdog.decode(_record(12, 1)) == (12, 1)
    assert watchdog.decode(_record(3, -1)) == (3, -1)
    assert watchdog.decode(_record(2 ** 31 - 1, 2 ** 31 - 1)) == (2 ** 31 - 1, 2 ** 31 - 1)


def test_a_wait_is_registered_once_and_named_by_its_code():
    code = watchdog.wait_code("gemm_rs(M=8, N=8, K=8, t=2, signal/p2p)", "rank 1's ARRIVED signal", 5.0)
    assert code >= 1
    assert watchdog.wait_code("gemm_rs(M=8, N=8, K=8, t=2, signal/p2p)", "rank 1's ARRIVED signal", 5.0) == code
    other = watchdog.wait_code("gemm_rs(M=8, N=8, K=8, t=2, signal/p2p)", "rank 1's SUMMED signal", 5.0)
    assert other != code
    message = watchdog.graph_wait_message(_record(code, 0))
    assert message.startswith("overlap_tp watchdog: gemm_rs(M=8, N=8, K=8, t=2, signal/p2p) waited 5 s for "
                              "rank 1's ARRIVED signal in a CUDA graph replay and saw 0")
    assert watchdog.WATCHDOG_ENV in message


def test_the_words_report_any_shape_unsigned():
    """A stuck plan's report reads its words: the p2p signals are [slots, t] (a 2-D read once raised in the
    watchdog's thread, which died, and the stuck rank hung instead of ending)."""
    import torch
    assert watchdog.unsigned_words(torch.tensor([3, -1], dtype=torch.int32)) == [3, 2 ** 32 - 1]
    assert watchdog.unsigned_words(torch.tensor([[1, 0], [0, -2]], dtype=torch.int32)) == [[1, 0], [0, 2 ** 32 - 2]]


def test_a_failing_report_still_ends_the_process(monkeypatch):
    """Whatever goes wrong while the stuck plan's words are read, the process still ends with the message."""
    ended = []
    monkeypatch.setattr(watchdog, "_read", lambda words: 1 / 0)
    monkeypatch.setattr(watchdog, "_end", ended.append)
    watchdog.Watchdog(5.0)._fail(watchdog.Watched("gemm_rs(M=8, N=8, K=8, t=2, signal/p2p)", (("signals", None),),
                                                  event=object()))
    assert len(ended) == 1 and ended[0].startswith("overlap_tp watchdog: gemm_rs(M=8, N=8, K=8, t=2, signal/p2p) did "
                                                   "not complete within 5 s")
    assert "its words unreadable (ZeroDivisionError" in ended[0]


def test_an_unknown_code_is_still_reported():
    message = watchdog.graph_wait_message(_record(10 ** 6, 7))
    assert "unregistered code 1000000" in message and "saw 7" in message


def test_the_thread_reports_a_mailbox_record_and_ends_the_process():
    """A record written into the mailbox (here by hand, into a plain CPU tensor standing in for the pinned
    one) ends the process with exit code 70 and the registered wait's message, within a poll or two."""
    script = textwrap.dedent("""
        import time
        import torch
        from overlap_tp.ops import watchdog
        dog = watchdog.watchdog()
        box = dog.open_mailbox(torch.zeros(1, dtype=torch.int64))
        code = watchdog.wait_code("ag_gemm(M=4, N=4, K=4, t=2, signal/p2p)", "rank 0's READY signal", 1.0)
        time.sleep(0.5)
        box[0] = (code << 32) | 3
        time.sleep(20)
        print("NOT REACHED")
    """)
    env = dict(os.environ, OVERLAP_TP_WATCHDOG_S="1")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 70, result.stderr[-2000:]
    assert ("overlap_tp watchdog: ag_gemm(M=4, N=4, K=4, t=2, signal/p2p) waited 1 s for rank 0's READY signal "
            "in a CUDA graph replay and saw 3") in result.stderr
    assert "NOT REACHED" not in result.stdout


def test_no_thread_watches_the_mailbox_when_the_watchdog_is_off():
    dog = watchdog.Watchdog(0.0)
    import torch
    dog.open_mailbox(torch.zeros(1, dtype=torch.int64))
    assert dog.thread is None


class FakeEvent:
    """memops.Event's contract on the host: record(stream) counts; `done` is what the poll's query answers."""

    def __init__(self):
        self.records, self.done = 0, False

    def record(self, stream):
        self.records += 1
        self.done = False


def test_only_plans_with_work_in_flight_are_listed_and_a_stuck_one_ends_the_process(monkeypatch):
    """Eager watching keeps a plan listed from its call until the GPU reached it: a plan built once and let go
    (the expert ops build one per routing) leaves the list at the next poll instead of being kept alive and
    polled for ever; its next call lists it again; one incomplete past the timeout is reported."""
    dog = watchdog.Watchdog(5.0)
    monkeypatch.setattr(dog, "_start", lambda: None)      # no thread: the test polls by hand
    plans = [watchdog.Watched(f"plan {i}", event=FakeEvent()) for i in range(100)]
    for plan in plans:
        dog.record(plan, stream=0)
        dog.record(plan, stream=0)                        # a second call while in flight: listed once
    assert len(dog.watched) == 100 and all(plan.event.records == 2 for plan in plans)

    def reached(item):
        return item.event.done

    for plan in plans[1:]:
        plan.event.done = True
    dog.poll(reached, now=0.0)
    assert dog.watched == [plans[0]] and plans[0].stuck_since == 0.0
    dog.record(plans[7], stream=0)                        # called again: listed again
    assert dog.watched == [plans[0], plans[7]] and plans[7].in_flight
    plans[7].event.done = True
    dog.poll(reached, now=4.0)
    assert dog.watched == [plans[0]]
    failures = []
    monkeypatch.setattr(dog, "_fail", failures.append)
    dog.poll(reached, now=5.5)
    assert failures == [plans[0]]


def test_a_call_its_kernel_reports_is_watched_until_its_number_is_in_the_progress_word(monkeypatch):
    """Watched.next_call (the p2p GEMM+ReduceScatter's signalling sum writes the number): listed without an event
    record, reached once the progress word holds the latest number (an older one is not enough), reported when it
    stays behind past the timeout; numbers are never 0 (0 tells the kernel to write nothing) and the watchdog off
    hands out 0."""
    import torch
    dog = watchdog.Watchdog(5.0)
    monkeypatch.setattr(dog, "_start", lambda: None)
    monkeypatch.setattr(watchdog, "_instance", dog)
    plan = watchdog.Watched("plan", event=FakeEvent())
    word = plan.progress_word(torch.zeros(1, dtype=torch.int32))
    numbers = [plan.next_call() for _ in range(3)]
    assert numbers == [1, 2, 3] and dog.watched == [plan] and plan.event.records == 0

    def reached(item):
        return item.reached(lambda event: True)

    word[0] = 2                                           # the GPU finished the second call, not the third
    dog.poll(reached, now=0.0)
    assert dog.watched == [plan]
    word[0] = 3
    dog.poll(reached, now=1.0)
    assert dog.watched == [] and not plan.in_flight
    plan.issued = 0x7FFFFFFF - 1
    assert [plan.next_call(), plan.next_call()] == [0x7FFFFFFF, 1]
    failures = []
    monkeypatch.setattr(dog, "_fail", failures.append)
    dog.poll(reached, now=2.0)
    dog.poll(reached, now=7.5)
    assert failures == [plan]
    monkeypatch.setattr(watchdog, "_instance", watchdog.Watchdog(0.0))
    assert plan.next_call() == 0


def test_the_poll_never_drops_the_last_reference_to_a_plan(monkeypatch):
    """A completed item leaves the list but stays referenced until the next record(), which lets it go on the
    recording thread: the polling thread never frees a plan's memory (symmetric memory freed there while the
    main thread captured a CUDA graph aborted the process)."""
    import gc
    import weakref
    dog = watchdog.Watchdog(5.0)
    monkeypatch.setattr(dog, "_start", lambda: None)
    evicted = watchdog.Watched("evicted plan", event=FakeEvent())
    alive = weakref.ref(evicted)
    dog.record(evicted, stream=0)
    evicted.event.done = True
    del evicted                                           # the plan cache let it go; the watchdog holds the last reference
    dog.poll(lambda item: item.event.done, now=0.0)
    gc.collect()
    assert dog.watched == [] and alive() is not None      # not dropped by the poll
    other = watchdog.Watched("next call", event=FakeEvent())
    dog.record(other, stream=0)
    gc.collect()
    assert alive() is None and dog.watched == [other]     # dropped by the recording thread's next record


def test_nothing_is_listed_when_the_watchdog_is_off():
    dog = watchdog.Watchdog(0.0)
    plan = watchdog.Watched("plan", event=FakeEvent())
    dog.record(plan, stream=0)
    assert dog.watched == [] and dog.thread is None


@pytest.mark.parametrize("connections", ["1", "8", None])
def test_words_stuck_behind_the_wait_are_explained_under_one_hardware_queue(monkeypatch, connections):
    """A SIGSTOPped peer's run on GPUs: every word read as unreadable, since with CUDA_DEVICE_MAX_CONNECTIONS=1 the read
    queues behind the stuck wait; the message says so there, and only there."""
    ended = []
    monkeypatch.setattr(watchdog, "_read", lambda words: watchdog.UNREADABLE if words == "stuck" else [1, 0])
    monkeypatch.setattr(watchdog, "_end", ended.append)
    if connections is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", connections)
    watchdog.Watchdog(5.0)._fail(watchdog.Watched("ag_gemm(M=8, N=8, K=8, t=2, signal/p2p)",
                                                  (("ready flags", "stuck"), ("peer signals", "read")), event=object()))
    assert "; ready flags unreadable; peer signals [1, 0]" in ended[0]
    assert ("one hardware queue" in ended[0]) == (connections == "1")
    ended.clear()
    watchdog.Watchdog(5.0)._fail(watchdog.Watched("ag_gemm(M=8, N=8, K=8, t=2, signal/p2p)",
                                                  (("peer signals", "read"),), event=object()))
    assert "one hardware queue" not in ended[0]   # every word read: nothing to explain
