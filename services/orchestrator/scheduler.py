"""Capacity, priority and fair-share math: pure functions the reconciler calls every pass.

``allocate`` decides how many pods each experiment should have, given the capacity the
backend can give Podium (free capacity plus what Podium's own pods already hold):

1. Priority is strict: a level is served (its minimums, then fair share up to its maximums)
   before any lower level gets anything, so a higher-priority submission scales lower ones in.
2. An experiment gets either at least ``min_pods`` or nothing (a population below its minimum
   is not worth running); when it gets nothing it is Pending with the reason.
3. Within one priority level the remainder is handed out one pod at a time to the experiment
   with the smallest dominant share (DRF), oldest first on ties, so concurrent experiments
   share fairly even when their pods differ in size.

The result depends only on the inputs, so consecutive passes agree and pods do not flap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import groupby


@dataclass(frozen=True)
class Res:
    """An amount of cluster resources: CPU cores, GPUs, memory bytes."""

    cpu: float = 0.0
    gpus: int = 0
    memory: int = 0

    def __add__(self, o: Res) -> Res:
        return Res(self.cpu + o.cpu, self.gpus + o.gpus, self.memory + o.memory)

    def __sub__(self, o: Res) -> Res:
        return Res(self.cpu - o.cpu, self.gpus - o.gpus, self.memory - o.memory)

    def times(self, n: int) -> Res:
        return Res(self.cpu * n, self.gpus * n, self.memory * n)

    def fits_in(self, cap: Res) -> bool:
        # A small epsilon keeps 0.1 + 0.2 CPU from failing to fit in 0.3.
        return self.cpu <= cap.cpu + 1e-9 and self.gpus <= cap.gpus and self.memory <= cap.memory

    def count_in(self, cap: Res) -> int:
        """How many of these fit in ``cap``."""
        limits = []
        for need, have in ((self.cpu, cap.cpu), (self.gpus, cap.gpus), (self.memory, cap.memory)):
            if need > 0:
                limits.append(max(0, math.floor(have / need + 1e-9)))
        return min(limits) if limits else 1 << 30

    def dominant_share(self, total: Res) -> float:
        shares = [
            used / cap
            for used, cap in (
                (self.cpu, total.cpu),
                (self.gpus, total.gpus),
                (self.memory, total.memory),
            )
            if cap > 0
        ]
        return max(shares, default=0.0)

    def describe(self) -> str:
        return f"{self.cpu:g} CPU, {self.gpus} GPU, {self.memory / 2**30:.3g} GiB"


@dataclass(frozen=True)
class Demand:
    experiment_id: str
    priority: int
    created_at: float
    min_pods: int
    max_pods: int
    per_pod: Res


@dataclass
class Allocation:
    pods: dict[str, int] = field(default_factory=dict)
    pending_reason: dict[str, str] = field(default_factory=dict)


def allocate(demands: list[Demand], capacity: Res) -> Allocation:
    out = Allocation()
    remaining = capacity
    ordered = sorted(demands, key=lambda d: (-d.priority, d.created_at, d.experiment_id))
    for _, level_iter in groupby(ordered, key=lambda d: d.priority):
        level = list(level_iter)
        admitted: list[Demand] = []
        for d in level:
            need = d.per_pod.times(d.min_pods)
            if not d.per_pod.fits_in(capacity):
                out.pods[d.experiment_id] = 0
                out.pending_reason[d.experiment_id] = (
                    f"one pod needs {d.per_pod.describe()}; the cluster has {capacity.describe()}"
                )
            elif need.fits_in(remaining):
                out.pods[d.experiment_id] = d.min_pods
                remaining = remaining - need
                admitted.append(d)
            else:
                out.pods[d.experiment_id] = 0
                out.pending_reason[d.experiment_id] = (
                    f"waiting for capacity: min_pods={d.min_pods} need {need.describe()}; "
                    f"free for this priority: {_nonneg(remaining).describe()}"
                )
        # Fair share of what is left, one pod at a time to the smallest dominant share.
        while True:
            candidates = [
                d
                for d in admitted
                if out.pods[d.experiment_id] < d.max_pods and d.per_pod.fits_in(remaining)
            ]
            if not candidates:
                break
            d = min(
                candidates,
                key=lambda d: (
                    d.per_pod.times(out.pods[d.experiment_id]).dominant_share(capacity),
                    d.created_at,
                    d.experiment_id,
                ),
            )
            out.pods[d.experiment_id] += 1
            remaining = remaining - d.per_pod
    return out


def _nonneg(r: Res) -> Res:
    return Res(max(r.cpu, 0.0), max(r.gpus, 0), max(r.memory, 0))


def launchable(target: int, active: int, per_pod: Res, free: Res) -> int:
    """How many pods to create now: up to the target, only into resources actually free.

    ``free`` already excludes pods still shutting down, so a preempting experiment's pods start
    as the preempted pods exit rather than overcommitting the cluster.
    """
    return max(0, min(target - active, per_pod.count_in(free)))


def backoff_delay(failures: int, initial: float, maximum: float) -> float:
    """Delay before replacing the ``failures``-th consecutive failed pod.

    A single failure (a node lost, a pod killed) is replaced at once; repeated failures back off
    exponentially, so a crash-looping experiment does not hammer the cluster.
    """
    if failures <= 1:
        return 0.0
    return min(maximum, initial * 2 ** (failures - 2))


def ensemble_shares(weights: dict[str, float]) -> dict[str, float]:
    """Each algorithm's share of an ensemble's pods (its weight, normalised), by name; empty
    for a single algorithm, whose pods need no algorithm of their own."""
    names = sorted(a for a, w in weights.items() if w > 0)
    total = sum(weights[a] for a in names)
    return {a: weights[a] / total for a in names} if len(names) > 1 else {}


def assign_algorithms(
    weights: dict[str, float], running: list[str | None], n: int
) -> list[str | None]:
    """The algorithms of ``n`` new pods of an ensemble: each the one furthest below its share
    of the pods among those ``running`` and those assigned before it; ties go to the heavier
    weight, then the name (None each for a single algorithm). Every algorithm of weight w
    gets its w-share of the pods (a population of two with ``{ppo: 1, sac: 1}`` runs one of
    each), where drawing each pod's algorithm at random would leave one out as often as not,
    and a failed pod is replaced by one of its own algorithm."""
    shares = ensemble_shares(weights)
    if not shares:
        return [None] * n
    counts = {a: sum(r == a for r in running) for a in shares}
    out: list[str | None] = []
    for _ in range(n):
        pods = sum(counts.values()) + 1  # with this one
        pick = max(shares, key=lambda a: (shares[a] * pods - counts[a], shares[a]))
        counts[pick] += 1
        out.append(pick)
    return out


def scale_in(weights: dict[str, float], running: list[str | None], n: int) -> list[int]:
    """Which ``n`` of the ``running`` pods to stop (their algorithms, oldest first; None: not
    known), newest first: each the newest pod of the algorithm furthest above its weight's
    share of the pods that stay (unknown ones first), so an ensemble scaled in keeps every
    algorithm its share, as ``assign_algorithms`` gave it out. Indices into ``running``."""
    shares = ensemble_shares(weights)
    if not shares:
        return list(range(len(running) - 1, len(running) - 1 - n, -1))
    left = list(range(len(running)))
    out: list[int] = []
    for _ in range(n):
        stay = len(left) - 1
        newest: dict[str | None, int] = {}  # per algorithm, its newest pod left
        surplus: dict[str | None, float] = {}  # pods above its share of those that stay
        for i in left:
            a = running[i]
            newest[a] = i
            surplus[a] = surplus.get(a, -shares.get(a, 0.0) * stay) + 1
        # The furthest above its share; of equals, the one whose newest pod is newest.
        pick = max(surplus, key=lambda a: (surplus[a], newest[a]))
        out.append(newest[pick])
        left.remove(newest[pick])
    return out
