"""A benchmark's child processes, each with a pipe back to the parent: start
them all, then wait for an answer from each, never without a deadline."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from typing import Any


def start(ctx: Any, target: Callable[..., None], args_per_child: Iterable[tuple]) -> tuple[list[Connection], list[Any]]:
    """One daemon process per args tuple, run as ``target(pipe_end, *args)``."""
    conns, procs = [], []
    for args in args_per_child:
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        proc.start()
        conns.append(conn)
        procs.append(proc)
    return conns, procs


def receive(conns: list[Connection], timeout_s: float, late: str) -> list[Any]:
    """One message from each pipe, in order; ``late`` says who did not answer in time."""
    out = []
    for conn in conns:
        if not conn.poll(timeout_s):
            raise RuntimeError(f"{late} within {timeout_s:.0f} s")
        out.append(conn.recv())
    return out


def stop(readers: list[Connection], reader_msg: Any, publishers: list[Connection], procs: list[Any]) -> None:
    """Ask every child to stop (readers with ``reader_msg``, publishers with
    "stop"), then join each for 30 s and kill the ones still running."""
    for conn in readers:
        conn.send(reader_msg)
    for conn in publishers:
        conn.send("stop")
    for proc in procs:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
