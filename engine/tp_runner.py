"""Tensor-parallel model runners: N ranks, each holding a 1/N shard of the model
(transformers' own tensor-parallel plan: q/k/v and gate/up split by columns, o and down
by rows with an all_reduce after them) and a KV pool for its local KV heads.

Rank 0 (`TPModelRunner`, in the serving process) keeps the scheduler and block manager
and is the runner LLMEngine steps. Each step it prepares the batch as one process would
and broadcasts the prepared tensors (token ids, positions, slot mapping, attention
metadata), then every rank runs the same forward on its shard and rank 0 samples. Swaps
are broadcast too: each rank copies its own blocks. The other ranks run `serve_rank`.

Failure: any error in a step or heartbeat (a rank died: its peers' collectives fail at
once; a rank hung: after `tp_timeout_s`) marks the runner failed for good, and
`check_health()` raises from then on, so the engine stops and fails every request. A
heartbeat thread pings the ranks when no step ran for a while, which also keeps their
receives from timing out on an idle server.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from . import distributed as tpd
from .config import EngineConfig
from .model_runner import ModelRunner
from .scheduler import SchedulerOutput

log = logging.getLogger("streamgate.engine")

_HEARTBEAT_S = 1.0


class RankFailure(RuntimeError):
    """A tensor-parallel rank died, hung or failed a collective: the engine cannot step."""


class ShardRunner(ModelRunner):
    """A ModelRunner on one rank's shard (every rank builds one, at the same time)."""

    def _auto_num_blocks(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Ranks size their pools alike (the block tables are shared): the fewest any rank fits."""
        n = torch.tensor([super()._auto_num_blocks(num_layers, num_kv_heads, head_dim)], device=self.device)
        dist.all_reduce(n, op=dist.ReduceOp.MIN)
        return int(n.item())


class TPModelRunner(ShardRunner):
    """Rank 0: spawns ranks 1..N-1, joins the group with them and drives every step."""

    def __init__(self, config: EngineConfig):
        from transformers import AutoConfig

        from .models import check_tensor_parallel, resolve_model

        n = config.tensor_parallel_size
        check_tensor_parallel(AutoConfig.from_pretrained(resolve_model(config.model)), n)
        if config.device.startswith("cuda") and torch.cuda.device_count() < n:
            raise ValueError(f"tensor_parallel_size={n} needs {n} CUDA devices, found {torch.cuda.device_count()}")
        if dist.is_initialized():
            raise RuntimeError("one tensor-parallel engine per process: torch.distributed's default group is "
                               "in use (close() the other engine first)")
        port = tpd.free_port()
        # The serving process's threads are shared out among the ranks on CPU.
        threads = max(1, torch.get_num_threads() // n) if config.device == "cpu" else torch.get_num_threads()
        self.ranks = tpd.Ranks(serve_rank, n, (n, port, config, threads))
        self.failed: str | None = None             # why the ranks can no longer step
        self._lock = threading.Lock()               # one collective sequence at a time
        self._stopped = threading.Event()
        def startup() -> None:
            tpd.init_group(0, n, port, config.device)
            super(TPModelRunner, self).__init__(dataclasses.replace(config, device=tpd.rank_device(config.device, 0)))
            tpd.loaded(config.tp_timeout_s)

        try:
            torch.set_num_threads(threads)
            self.ranks.wait_start(startup)
        except BaseException:
            self.ranks.stop(grace_s=0.0)
            tpd.destroy_group()
            raise
        self.channel = tpd.StepChannel(self.device)
        self._last_sent = time.monotonic()
        self._heartbeat = threading.Thread(target=self._beat, name="streamgate-tp-heartbeat", daemon=True)
        self._heartbeat.start()
        log.info("tensor parallel: %d ranks (%s), KV pool of %d blocks per rank", n,
                 dist.get_backend(), self.num_blocks)

    # -- the step -----------------------------------------------------------------------------
    def run(self, batch: SchedulerOutput) -> torch.Tensor:
        input_ids, positions, sample_rows, meta = prepared = self._prepare(batch)
        with _Collective(self):
            self.channel.send(("run", input_ids, positions, sample_rows, dataclasses.replace(meta, cache=None)))
            return self.execute(*prepared)

    def swap(self, batch: SchedulerOutput) -> int:
        if not (batch.swap_out or batch.swap_in):
            return 0
        with _Collective(self):
            self.channel.send(("swap", batch.swap_out, batch.swap_in))
            return super().swap(batch)

    # -- health ---------------------------------------------------------------------------------
    def check_health(self) -> None:
        reasons = [f"{rank} exited" for rank in self.ranks.dead()]
        if self.failed is not None and self.failed not in reasons:
            reasons.append(self.failed)
        if reasons:
            self.failed = self.failed or reasons[0]
            raise RankFailure(f"tensor parallelism failed: {'; '.join(reasons)}")

    def _beat(self) -> None:
        """Ping the ranks after a second without a step; notice dead ones between steps."""
        try:
            while not self._stopped.wait(_HEARTBEAT_S / 4):
                self.check_health()
                if time.monotonic() - self._last_sent < _HEARTBEAT_S or not self._lock.acquire(blocking=False):
                    continue
                if self._stopped.is_set():              # close() ran in between
                    self._lock.release()
                    return
                self.ping(locked=True)
        except RankFailure as exc:
            log.error("%s", exc)

    def ping(self, locked: bool = False) -> float:
        """One broadcast and one all_reduce with every rank (the heartbeat; the benchmark's
        latency floor); returns the seconds it took."""
        start = time.perf_counter()
        with _Collective(self, locked=locked):
            self.channel.send(("ping",))
            tpd.barrier()
        return time.perf_counter() - start

    def close(self) -> None:
        """Stop the heartbeat and every rank, and leave the group (bounded: never hangs)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        got = self._lock.acquire(timeout=self.config.tp_timeout_s)
        told = False
        try:
            if got and self.failed is None and not self.ranks.dead():
                self.channel.send(("stop",))
                told = True
        except Exception as exc:                   # the ranks are stopped below either way
            log.warning("tensor parallel: stop message failed: %s", exc)
        self.ranks.stop(grace_s=10.0 if told else 0.0)
        tpd.destroy_group()
        if got:
            self._lock.release()


class _Collective:
    """Holds the runner's lock around one message and the collectives that follow it;
    any error there is a rank failure (the ranks may be out of step): remembered, raised."""

    def __init__(self, runner: TPModelRunner, locked: bool = False):
        self.runner, self.locked = runner, locked

    def __enter__(self):
        if not self.locked:
            self.runner._lock.acquire()
        try:
            self.runner.check_health()
        except RankFailure:
            self.runner._lock.release()
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        self.runner._last_sent = time.monotonic()
        self.runner._lock.release()
        if exc is not None and not isinstance(exc, RankFailure):
            self.runner.failed = f"{type(exc).__name__}: {exc}"
            dead = [f"{rank} exited" for rank in self.runner.ranks.dead_after_failure()]
            raise RankFailure(f"tensor parallelism failed: {'; '.join([*dead, self.runner.failed])}") from exc
        return False


def serve_rank(rank: int, world_size: int, port: int, config: EngineConfig, threads: int, parent_pid: int) -> None:
    """A spawned rank's whole life: join the group, load its shard, then run what rank 0
    broadcasts until it says stop (or the group fails, which ends the process)."""
    os.environ["LOCAL_RANK"] = str(rank)          # transformers binds the rank's device by it
    # Rank 0 decides when the ranks end: a Ctrl-C or a SIGTERM sent to the whole process
    # group must not kill them under a server that is still draining its streams.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(threads)
    tpd.exit_with_parent(parent_pid)
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(levelname)s %(name)s: %(message)s")
    tpd.init_group(rank, world_size, port, config.device)
    runner = ShardRunner(dataclasses.replace(config, device=tpd.rank_device(config.device, rank)))
    tpd.loaded(config.tp_timeout_s)
    channel = tpd.StepChannel(runner.device)
    try:
        while True:
            kind, *body = channel.recv()
            if kind == "run":
                input_ids, positions, sample_rows, meta = body
                runner.execute(input_ids, positions, sample_rows, dataclasses.replace(meta, cache=runner.kv_cache))
            elif kind == "swap":
                runner.kv_cache.swap(*body)
            elif kind == "ping":
                tpd.barrier()
            else:
                break
    except Exception as exc:                         # rank 0 or a peer is gone: nothing left to serve
        log.error("stopping: %s: %s", type(exc).__name__, exc)
        sys.exit(1)
    tpd.destroy_group()
