"""torch.distributed plumbing for tensor parallelism: the process group, the ranks'
processes, and the channel that carries each step from rank 0 to the others.

Rank 0 is the serving process (its engine thread); ranks 1..N-1 are processes it spawns.
The group is gloo on CPU; on CUDA the model's collectives run on NCCL (one device per
rank) while the step messages, which are small pickled CPU objects, stay on gloo. Every
collective has the group's timeout, so a hung rank fails the engine within it; a rank
that dies closes its sockets and its peers' collectives fail at once.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

log = logging.getLogger("streamgate.engine")

_CPU = torch.device("cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Start-up (spawning, imports, loading weights, maybe building the kernel) may take minutes
# on a busy host; the group's collectives get their real timeout once every rank is loaded.
STARTUP_TIMEOUT_S = 600.0


def init_group(rank: int, world_size: int, port: int, device: str) -> None:
    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=STARTUP_TIMEOUT_S))


def loaded(timeout_s: float) -> None:
    """Every rank calls this once its shard is loaded: wait for the others, then let each
    collective wait at most `timeout_s` from now on."""
    barrier()
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s))


def rank_device(device: str, rank: int) -> str:
    """One device per rank: rank r uses cuda:r."""
    return f"cuda:{rank}" if device.startswith("cuda") else device


def moved(obj, device: torch.device):
    """`obj` with every tensor inside it (through lists, tuples and dataclasses) on `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(moved(x, device) for x in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: moved(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj)})
    return obj


class StepChannel:
    """Rank 0 broadcasts one message per step (or swap, ping, stop); every other rank
    receives them in the same order. Tensors travel on CPU and land on the receiver's
    device. `seconds` adds up the time spent broadcasting (the benchmark reads it)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = 0.0

    def send(self, message: tuple) -> None:
        start = time.perf_counter()
        dist.broadcast_object_list([moved(message, _CPU)], src=0, device=_CPU)
        self.seconds += time.perf_counter() - start

    def recv(self) -> tuple:
        box = [None]
        dist.broadcast_object_list(box, src=0, device=_CPU)
        return moved(box[0], self.device)


def barrier() -> None:
    """A one-number all_reduce on gloo: returns once every rank took part (or raises
    after the group's timeout), which is what a heartbeat needs."""
    dist.all_reduce(torch.ones(1))


class Ranks:
    """The spawned ranks 1..N-1: daemon processes, stopped by rank 0 (or by its exit). Each
    rank reports on `reports` that its start-up code began, and its error if start-up fails."""

    def __init__(self, target, world_size: int, args: tuple):
        ctx = mp.get_context("spawn")
        self.reports = ctx.SimpleQueue()
        self.started: set[int] = set()
        self.errors: dict[int, str] = {}
        self.procs = [ctx.Process(target=_rank_main, args=(target, self.reports, rank, *args, os.getpid()),
                                  daemon=True, name=f"streamgate-rank{rank}") for rank in range(1, world_size)]
        for p in self.procs:
            p.start()
        # Before multiprocessing's own exit hook (atexit runs last-registered first), which
        # would SIGTERM the daemon ranks, which ignore it, and then join them forever.
        atexit.register(self.stop, grace_s=0.0)

    def wait_start(self, startup, poll_s: float = 0.1):
        """Run `startup` (rank 0's side of joining the group and loading) on a helper thread
        while watching the ranks: if one dies first, raise at once with its error instead of
        waiting out the group's start-up timeout with the rendezvous. The thread left behind
        then ends with that timeout."""
        box: dict = {}

        def run() -> None:
            try:
                box["result"] = startup()
            except BaseException as exc:  # noqa: BLE001 (handed to the caller)
                box["error"] = exc

        thread = threading.Thread(target=run, name="streamgate-tp-startup", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(poll_s)
            if dead := self.dead():
                time.sleep(poll_s)                      # let a dying rank's report arrive
                raise RuntimeError(self.startup_failure(dead))
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def startup_failure(self, dead: list[str]) -> str:
        while not self.reports.empty():
            rank, kind, text = self.reports.get()
            (self.started.add(rank) if kind == "started" else self.errors.__setitem__(rank, text))
        lines = [f"tensor parallelism: {', '.join(dead)} during start-up"]
        for r, p in enumerate(self.procs, 1):
            if p.is_alive():
                continue
            if r in self.errors:
                lines.append(f"rank {r} failed: {self.errors[r]}")
            elif r not in self.started:
                lines.append(
                    f"rank {r} died before its start-up code ran. Ranks are processes started with "
                    "multiprocessing's 'spawn' method, which re-imports the main module: a script that "
                    "builds an engine with tensor_parallel_size > 1 must do it under "
                    "`if __name__ == \"__main__\":` (as vLLM and torch.multiprocessing require); the "
                    "rank's own error is printed above on stderr")
        return "\n".join(lines)

    def dead(self) -> list[str]:
        """'rank R (exit code C)' for each rank process that is gone."""
        return [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(self.procs, 1) if not p.is_alive()]

    def dead_after_failure(self, wait_s: float = 1.0, poll_s: float = 0.01) -> list[str]:
        """dead(), after waiting up to `wait_s` for a rank to be seen gone: a collective fails as
        soon as a dying rank's sockets close, a moment before the process can be reaped (longer
        on a loaded host), and the failure should name the rank."""
        deadline = time.monotonic() + wait_s
        while not (gone := self.dead()) and time.monotonic() < deadline:
            time.sleep(poll_s)
        return gone

    def stop(self, grace_s: float) -> None:
        """Wait up to `grace_s` for the ranks to exit, then kill them (they ignore SIGTERM)."""
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)


def _rank_main(target, reports, rank: int, *args) -> None:
    """A spawned rank's entry: report that start-up began, run `target`, and report the
    error that ends it (the parent names it if the rank dies during start-up)."""
    reports.put((rank, "started", ""))
    try:
        target(rank, *args)
    except BaseException as exc:
        reports.put((rank, "error", f"{type(exc).__name__}: {exc}"))
        raise


def exit_with_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """In a spawned rank: leave at once if the serving process is gone (even by SIGKILL,
    which runs no clean-up there)."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(interval_s)

    threading.Thread(target=watch, name="streamgate-parent-watch", daemon=True).start()


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
