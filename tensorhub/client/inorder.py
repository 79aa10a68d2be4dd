"""One helper thread that runs jobs in the order they were handed to it.

The chunk checks (``verify``) hand it a CRC for every piece a checked pull
lands, from the pull's thread, between two copies: whatever the hand-off costs
there is added to the pull. ``concurrent.futures.ThreadPoolExecutor.submit``
cost 35-45 µs a job on the reference machine (a Future with its condition, a
work item, a semaphore for its idle-thread count), a ``SimpleQueue.put`` about
1 µs; over 1 GiB in 8 MiB pieces that is 5 ms of a 0.3 s pull.

Jobs run one at a time, in order: a job may use the results of jobs handed in
before it (``Job.result`` raises if it has not run, which is a bug).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any


class Job:
    """A job's outcome: ``done`` once it ran; ``result()`` its value or its error."""

    __slots__ = ("_error", "_value", "args", "cancelled", "done", "fn")

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn, self.args = fn, args
        self.done = False
        self.cancelled = False
        self._value: Any = None
        self._error: Exception | None = None

    def result(self) -> Any:
        if not self.done:
            raise RuntimeError("InOrderWorker: a job's result was asked for before it ran")
        if self._error is not None:
            raise self._error
        return self._value


class InOrderWorker:
    """A thread that runs ``submit``-ted jobs one at a time, in order, until ``close``."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._ran_one = threading.Condition()  # notified after every job: ``wait`` sleeps on it
        self._closed = False
        self.ran = 0  # jobs run so far: a caller polling often can tell that nothing changed
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Job:
        if self._closed:
            raise RuntimeError("InOrderWorker: submit after close")
        job = Job(fn, args)
        self._jobs.put(job)
        return job

    def wait(self, jobs: Iterable[Job], timeout_s: float) -> None:
        """Return once every one of ``jobs`` ran, or ``timeout_s`` passed."""
        jobs = list(jobs)
        deadline = time.monotonic() + timeout_s
        with self._ran_one:
            while not all(job.done for job in jobs):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._ran_one.wait(left)

    def close(self) -> None:
        """Drop the jobs not begun (``cancelled``; they never run) and wait for
        the one running: after this no job touches anything."""
        self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancelled = True
        self._jobs.put(None)
        self._thread.join()  # a job is a CRC of a chunk at most: milliseconds

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job._value = job.fn(*job.args)
            except Exception as e:  # noqa: BLE001 (handed to whoever asks for the result)
                job._error = e
            job.done = True
            self.ran += 1
            with self._ran_one:
                self._ran_one.notify_all()
