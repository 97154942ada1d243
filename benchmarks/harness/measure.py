"""Running measurements: worker processes that start together on a barrier, the timing of a
run, the rotating order that interleaves measurements."""

from __future__ import annotations

import multiprocessing
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

T = TypeVar("T")

#: how long a worker waits for the others at the start of a measurement
BARRIER_TIMEOUT = 300.0

#: what a worker does with one command: ``handle(command, barrier)``, its result sent back;
#: it waits on ``barrier`` (``barrier.wait(BARRIER_TIMEOUT)``) just before it starts the clock
Handler = Callable[[Any, Any], Any]
#: opens what a worker keeps for the whole run (``setup(index, *args)``, a context manager:
#: a generator function under ``contextlib.contextmanager``) and yields its :data:`Handler`
Setup = Callable[..., AbstractContextManager[Handler]]


def rotated(items: Sequence[T], k: int) -> list[T]:
    """``items`` starting at ``k`` (modulo their number): the order of the ``k``-th round."""
    k %= len(items)
    return [*items[k:], *items[:k]]


def timed(run: Callable[..., T], *args: Any) -> tuple[T, float, float, float]:
    """``run(*args)``, and the ``perf_counter`` at its start and its end (``CLOCK_MONOTONIC``:
    comparable across processes) and the CPU seconds it took this process."""
    cpu, start = time.process_time(), time.perf_counter()
    result = run(*args)
    end = time.perf_counter()
    return result, start, end, time.process_time() - cpu


def _serve(
    index: int,
    setup: Setup,
    args: tuple[Any, ...],
    barriers: dict[int, Any],
    commands: Any,
    results: Any,
    limit: int | None,
) -> None:
    """A worker process: ``setup`` once, then one measurement per command until ``None``.
    A failure is reported (its traceback) and breaks the barrier, so that the others of the
    measurement stop waiting; the worker goes on with the next command."""
    barrier = None
    try:
        with setup(index, *args) as handle:
            results.put(("ready", index, None))
            while (command := commands.get()) is not None:
                parties, payload = command
                barrier = barriers[parties]
                try:
                    results.put(("done", index, handle(payload, barrier)))
                except Exception:
                    barrier.abort()
                    results.put(("failed", index, traceback.format_exc(limit=limit)))
    except BaseException:
        if barrier is not None:
            barrier.abort()
        results.put(("failed", index, traceback.format_exc(limit=limit)))


class Pool:
    """``max(sizes)`` worker processes (``multiprocessing`` "spawn"), started once and kept
    for the whole run, each set up by ``setup(index, *args)`` (a module-level function of the
    script, so that a spawned process finds it); a measurement runs on the first ``parties``
    of them, a size of ``sizes``, which start together on that size's barrier.

    ``timeout``: how long to wait for a worker's answer (``ready_timeout`` for the first, its
    start); ``name``: the processes' names (``name-<index>``); ``limit``: how many frames of
    a failed worker's traceback to show (``None``: all).
    """

    def __init__(
        self,
        setup: Setup,
        args: tuple[Any, ...],
        sizes: Iterable[int],
        *,
        timeout: float,
        ready_timeout: float | None = None,
        name: str = "bench",
        limit: int | None = None,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        sizes = sorted(set(sizes))
        self.timeout = timeout
        self.results = ctx.Queue()
        self.barriers = {p: ctx.Barrier(p) for p in sizes}
        self.commands = [ctx.Queue() for _ in range(max(sizes))]
        self.procs = [
            ctx.Process(
                target=_serve,
                args=(i, setup, args, self.barriers, q, self.results, limit),
                name=f"{name}-{i}",
                daemon=True,
            )
            for i, q in enumerate(self.commands)
        ]
        for p in self.procs:
            p.start()
        self._answers(len(self.procs), "ready", ready_timeout or timeout)

    def _answers(self, count: int, kind: str, timeout: float) -> list[Any]:
        """``count`` answers of ``kind``, by worker; a failed worker stops the run."""
        answers = sorted((self.results.get(timeout=timeout) for _ in range(count)), key=lambda m: m[1])
        failed = [f"worker {index} failed:\n{payload}" for what, index, payload in answers if what != kind]
        if failed:
            raise SystemExit("\n".join(failed))
        return [payload for _, _, payload in answers]

    def run(self, commands: Sequence[Any]) -> list[Any]:
        """Command ``k`` to worker ``k``, all at once; their results, by worker."""
        parties = len(commands)
        self.barriers[parties].reset()  # a measurement that failed may have broken it
        for queue, command in zip(self.commands, commands, strict=False):
            queue.put((parties, command))
        return self._answers(parties, "done", self.timeout)

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
