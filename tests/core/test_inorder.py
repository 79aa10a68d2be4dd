"""``InOrderWorker``: the chunk checks' helper thread."""

from __future__ import annotations

import threading
import time

import pytest

from tensorhub.client.inorder import InOrderWorker


def test_jobs_run_in_order_and_a_later_job_sees_earlier_results() -> None:
    worker = InOrderWorker("test-inorder")
    try:
        seen: list[int] = []
        jobs = [worker.submit(lambda i=i: seen.append(i) or i * i) for i in range(200)]
        joined = worker.submit(lambda: sum(job.result() for job in jobs))  # as a chunk's join reads its pieces' CRCs
        worker.wait([joined], 10)
        assert joined.done and joined.result() == sum(i * i for i in range(200))
        assert seen == list(range(200))
        assert worker.ran == 201  # every job counted once it ran
    finally:
        worker.close()


def test_an_error_is_kept_for_the_result_and_the_worker_goes_on() -> None:
    worker = InOrderWorker("test-inorder")
    try:
        bad = worker.submit(lambda: 1 // 0)
        good = worker.submit(lambda: "ok")
        worker.wait([bad, good], 10)
        with pytest.raises(ZeroDivisionError):
            bad.result()
        assert good.result() == "ok"
    finally:
        worker.close()


def test_wait_returns_at_its_timeout_and_a_result_asked_too_early_is_an_error() -> None:
    worker = InOrderWorker("test-inorder")
    gate = threading.Event()
    try:
        slow = worker.submit(gate.wait, 10)
        t0 = time.monotonic()
        worker.wait([slow], 0.2)
        assert 0.15 < time.monotonic() - t0 < 2 and not slow.done
        with pytest.raises(RuntimeError, match="before it ran"):
            slow.result()
    finally:
        gate.set()
        worker.close()


def test_close_drops_the_jobs_not_begun_and_waits_for_the_running_one() -> None:
    worker = InOrderWorker("test-inorder")
    started, gate = threading.Event(), threading.Event()
    ran: list[str] = []

    def running() -> None:
        started.set()
        gate.wait(10)
        ran.append("running")

    first = worker.submit(running)
    later = [worker.submit(ran.append, "later") for _ in range(5)]
    assert started.wait(10)
    threading.Timer(0.2, gate.set).start()
    worker.close()  # returns only once ``running`` has finished
    assert ran == ["running"] and first.done
    assert all(job.cancelled and not job.done for job in later)
    with pytest.raises(RuntimeError, match="after close"):
        worker.submit(ran.append, "too late")
