"""Reported reads applied behind the reply, on a thread of lower priority (server/worker/touches.py)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from cachefs.priority import lower_this_thread
from cachefs.server.worker.touches import TouchQueue
from helpers import wait_for


class _Recorder:
    def __init__(self, gate: threading.Event | None = None) -> None:
        self.batches: list[tuple[list[str], str]] = []
        self.gate = gate
        self.nice: list[int] = []
        self._lock = threading.Lock()

    def __call__(self, digests) -> None:
        if self.gate is not None:
            assert self.gate.wait(30)
        if sys.platform.startswith("linux"):
            self.nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        with self._lock:
            self.batches.append((list(digests), threading.current_thread().name))

    def digests(self) -> list[str]:
        with self._lock:
            return [d for batch, _ in self.batches for d in batch]


def test_reports_are_applied_in_order_on_the_background_thread():
    applied = _Recorder()
    queue = TouchQueue(applied)
    try:
        for i in range(50):
            queue.submit([f"{i:04d}a", f"{i:04d}b"])
        assert queue.flush(30)
        assert applied.digests() == [f"{i:04d}{s}" for i in range(50) for s in "ab"]
        assert {name for _, name in applied.batches} == {"cachefs-touches"}
        assert queue.applied_inline == 0
        queue.submit([])  # nothing to apply: no batch
        assert queue.flush(30) and len(applied.batches) <= 50
    finally:
        queue.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux's")
def test_the_thread_runs_at_a_lower_priority_than_the_reporters():
    applied = _Recorder()
    queue = TouchQueue(applied, nice=5)
    try:
        queue.submit(["x"])
        assert queue.flush(30)
        mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert applied.nice == [min(19, mine + 5)]
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # this thread unchanged
    finally:
        queue.close()
    assert lower_this_thread(0) is False


def test_a_reporter_applies_its_own_batch_when_the_queue_is_full():
    gate = threading.Event()
    applied = _Recorder(gate)
    queue = TouchQueue(applied, max_pending=4)
    try:
        queue.submit(["a", "b", "c"])  # taken by the thread, which waits on the gate
        assert wait_for(lambda: not queue._batches, timeout=30)
        done = threading.Event()
        caller = threading.Thread(target=lambda: (queue.submit(["d", "e"]), done.set()))
        caller.start()  # 3 + 2 > 4: applied on the caller's thread (held by the gate too)
        assert wait_for(lambda: queue.applied_inline == 1, timeout=30)
        assert not queue.flush(0.05)  # the first batch is still being applied
        gate.set()
        caller.join(30)
        assert done.is_set() and queue.flush(30)
        assert sorted(applied.digests()) == ["a", "b", "c", "d", "e"]
        assert [batch for batch, name in applied.batches if name != "cachefs-touches"] == [["d", "e"]]
    finally:
        gate.set()
        queue.close()


def test_close_applies_what_is_queued_and_later_reports_apply_inline():
    gate = threading.Event()
    applied = _Recorder(gate)
    queue = TouchQueue(applied)
    queue.submit(["a"])
    queue.submit(["b"])
    gate.set()
    queue.close(30)
    assert sorted(applied.digests()) == ["a", "b"]
    queue.submit(["c"])  # closed: on this thread
    assert applied.digests()[-1] == "c" and applied.batches[-1][1] == threading.current_thread().name


def test_a_failing_apply_loses_only_its_batch():
    seen: list[str] = []

    def apply(digests) -> None:
        if "bad" in digests:
            raise RuntimeError("index gone")
        seen.extend(digests)

    queue = TouchQueue(apply)
    try:
        queue.submit(["bad"])
        queue.submit(["good"])
        assert queue.flush(30) and seen == ["good"]
    finally:
        queue.close()
    with pytest.raises(ValueError):
        TouchQueue(apply, max_pending=0)
