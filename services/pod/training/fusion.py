"""Learner fusion: N learner replicas, each on its own shard of data, averaged every epoch.

Each replica runs its own worker (its own env slice and seed) and learner; at the end of every
update epoch the replicas all-reduce the mean of their network parameters *and* their Adam moments
through ``torch.distributed`` (gloo, on CPU and CUDA tensors alike), so they leave each epoch
identical, as if one learner had taken the averaged step. That is the paper's "several learners
fused by averaging parameters"; it scales the data per update with the number of learners without a
parameter server."""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.logs import get_logger


class StateAverager:
    """Callable that replaces a trainer's weights, Adam moments and statistics by their group
    mean (``state``: services/pod/algorithms/ppo.py's, written in place): one all-reduce per
    dtype (float32 weights and moments, float64 statistics), whatever the number of layers.
    Adam's step counts are equal on every replica (same number of minibatches) and are left
    alone. Running observation statistics are averaged too: with equal counts the mean of
    means is exact and the mean of variances leaves out the (small) spread between replicas."""

    KEYS = ("params", "exp_avg", "exp_avg_sq", "obs_mean", "obs_var", "ret_mean", "ret_var")

    def __init__(self, state: dict[str, torch.Tensor], shape: object = None) -> None:
        self.state = state

    def _groups(self) -> dict[torch.dtype, list[torch.Tensor]]:
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for key in self.KEYS:
            groups.setdefault(self.state[key].dtype, []).append(self.state[key])
        return groups

    @staticmethod
    def _unpack(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        parts = flat.split([t.numel() for t in tensors])
        torch._foreach_copy_(tensors, [p.view_as(t) for p, t in zip(parts, tensors, strict=True)])

    @torch.no_grad()
    def __call__(self, state: object = None) -> None:
        world = dist.get_world_size()
        if world == 1:
            return
        for tensors in self._groups().values():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            self._unpack(flat / world, tensors)

    @torch.no_grad()
    def broadcast(self, src: int = 0) -> None:
        """Make every replica start from ``src``'s weights (and moments, statistics)."""
        if dist.get_world_size() == 1:
            return
        for tensors in self._groups().values():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.broadcast(flat, src)
            self._unpack(flat, tensors)


def agree(flag: bool, src: int = 0) -> bool:
    """Every replica gets ``src``'s ``flag`` (e.g. rank 0's decision to stop)."""
    value = torch.tensor([int(flag)])
    dist.broadcast(value, src)
    return bool(value.item())


# Forming the group (spawn, import, gloo's mesh) is bounded on its own: a replica that never
# joins raises instead of holding the pod for the collectives' allowance, which stays gloo's
# default, since a replica may wait at an all-reduce while the other compiles.
FORM_TIMEOUT = timedelta(seconds=120)
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
FORM_ATTEMPTS = 2
LOOPBACK = "127.0.0.1"
log = get_logger(__name__)


class GroupFormationError(RuntimeError):
    """The group did not form; nothing was trained yet, so forming it again is safe."""


def _joined_key(rank: int) -> str:
    return f"podium/replica/{rank}/joined"


def _entry(rank: int, world: int, store: dist.Store, fn: Callable[..., Any], args: tuple) -> Any:
    # gloo whatever the device: a pod's replicas share its device, and NCCL refuses two ranks on
    # one GPU ("Duplicate GPU detected", seen on an H100) and any CPU tensor (``agree``'s flag);
    # gloo all-reduces and broadcasts CUDA tensors too.
    try:
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=FORM_TIMEOUT
        )
    except RuntimeError as exc:  # torch's DistError and gloo's connect errors alike
        raise GroupFormationError(f"rank {rank} could not join the group: {exc}") from exc
    dist.distributed_c10d._set_pg_timeout(COLLECTIVE_TIMEOUT)
    try:
        return fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def _replica_entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    """A spawned replica: join rank 0's store, ``_entry``, then exit at once. Left to interpreter
    finalization, gloo's worker threads are sometimes destroyed while still joinable and the
    process dies by SIGABRT ("terminate called without an active exception") after its work."""
    code = 0
    try:
        store = dist.TCPStore(LOOPBACK, port, world, is_master=False, timeout=FORM_TIMEOUT)
        store.set(_joined_key(rank), "1")
        _entry(rank, world, store, fn, args)
    except SystemExit as exc:  # sys.exit(n) in the replica: keep its meaning
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    logging.shutdown()  # os._exit skips atexit: flush the log handlers and streams here
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _await_replicas(store: dist.TCPStore, others: list[BaseProcess]) -> None:
    """Wait until every spawned replica has joined the store; one that exits first (killed, out
    of memory, unable to start) fails the group now, not at the end of the rendezvous."""
    deadline = time.monotonic() + FORM_TIMEOUT.total_seconds()
    waiting = dict(enumerate(others, start=1))
    while waiting:
        for rank, proc in list(waiting.items()):
            if store.check([_joined_key(rank)]):
                del waiting[rank]
            elif proc.exitcode is not None:
                raise GroupFormationError(
                    f"learner replica {rank} exited with {proc.exitcode} before joining the group"
                )
        if waiting and time.monotonic() > deadline:
            raise GroupFormationError(
                f"learner replicas {sorted(waiting)} did not join the group within "
                f"{FORM_TIMEOUT.total_seconds():.0f} s"
            )
        time.sleep(0.05)


def run_group(
    fn: Callable[..., Any],
    world: int,
    args: tuple = (),
    rank0_args: tuple | None = None,
) -> Any:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks in one process group; return rank 0's.

    Rank 0 runs in this process (so it can report progress to the caller, with ``rank0_args`` in
    place of ``args`` for things that cannot be pickled, like callbacks); the others are spawned,
    not forked, since forking a process that runs torch threads is unsafe: ``fn`` must be
    importable at module level. A replica that fails makes the call raise. A group that does not
    form (a replica dead before joining, a connect timed out) is formed once more first."""
    for attempt in range(1, FORM_ATTEMPTS):
        try:
            return _run_group_once(fn, world, args, rank0_args)
        except GroupFormationError as exc:
            log.warning("learner_group.retry", attempt=attempt, reason=str(exc))
    return _run_group_once(fn, world, args, rank0_args)


def _run_group_once(
    fn: Callable[..., Any], world: int, args: tuple, rank0_args: tuple | None
) -> Any:
    # The store listens on a port the kernel picks and keeps (no free-port probe to race).
    store = dist.TCPStore(
        LOOPBACK, 0, world, is_master=True, timeout=FORM_TIMEOUT, wait_for_workers=False
    )
    ctx = mp.get_context("spawn")
    others = [
        ctx.Process(target=_replica_entry, args=(rank, world, store.port, fn, args), daemon=True)
        for rank in range(1, world)
    ]
    for proc in others:
        proc.start()
    done = False
    try:
        _await_replicas(store, others)
        result = _entry(0, world, store, fn, rank0_args if rank0_args else args)
        done = True
    finally:
        # After a failure here the replicas may wait at a collective rank 0 will never join.
        for proc in others:
            proc.join(timeout=60 if done else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if failed := [p.exitcode for p in others if p.exitcode != 0]:
        raise RuntimeError(f"learner replicas exited with {failed}")
    return result
