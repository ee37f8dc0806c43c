"""All of the executor's torch work on one thread: the process's main thread.

Why one thread. torch's CPU kernels (and the inductor-compiled ones) parallelise with OpenMP, GNU
libgomp in the CPU wheel, which keeps a separate team of worker threads for every thread that
starts parallel regions. gRPC runs each call on whichever thread of its pool takes it, so steps ran
on up to four pool threads, each with its own team, beside the main thread's team from loading:
on a 2-core machine, six OpenMP threads for two cores. When libgomp manages more threads than
there are CPUs it cuts its spin-wait to a token count (`do_spin` in libgomp's config/linux/wait.h
uses the throttled spin count when gomp_managed_threads > gomp_available_cpus), so its workers go
to sleep in the kernel after every parallel region and every op pays a futex wake-up. Measured in
the served stack: the executor kept its two cores 81-86% busy while computing, against 99.5% for
the same steps run on one thread in-process (bench/RESULTS.md, section 2b).

So the gRPC handlers keep their ordering and epoch logic, and hand the torch work (the handshake's
KV allocation, each step) to the main thread, which loaded the model and whose OpenMP team is the
only one. (In-process tests build the servicer without a loop: it then runs the work inline.)
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

# How often the serving thread looks at its stop event when no work comes.
POLL_SECONDS = 0.2


class ComputeLoopClosed(RuntimeError):
    """The loop stopped (the executor is shutting down) before the work could run."""


class ComputeLoop:
    """Runs callables, one at a time and in arrival order, on the thread that calls `serve`."""

    def __init__(self) -> None:
        self._work: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple]] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders `submit`'s put against `serve`'s final drain
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue `fn(*args)` for the loop's thread; the Future has its result or its exception."""
        fut: Future = Future()
        with self._lock:
            if self._closed:
                fut.set_exception(ComputeLoopClosed("the executor is shutting down"))
            else:  # queued until `serve` runs, if it has not started yet
                self._work.put((fut, fn, args))
        return fut

    def serve(self, stop: threading.Event) -> None:
        """Run queued work on this thread until `stop` is set; then fail what is still queued."""
        try:
            while not stop.is_set():
                try:
                    fut, fn, args = self._work.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    continue
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # the caller re-raises it; the loop goes on
                    fut.set_exception(e)
        finally:
            with self._lock:
                self._closed = True
            while True:
                try:
                    fut, _, _ = self._work.get_nowait()
                except queue.Empty:
                    break
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(ComputeLoopClosed("the executor is shutting down"))
