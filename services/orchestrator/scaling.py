"""How one experiment scales toward its target this pass: a pure plan, applied by the reconciler.

``plan_scale`` decides from the experiment's spec, its status, its live pods, its target and
the free capacity alone (no backend, no leaderboard, no clock but ``now``): which pods to stop
(scale in), how many pods to create and with which algorithm, the env steps each new pod may
take, why it launches fewer than the target, and whether the experiment has ended (no pod
could train a step of what is left of its env-step budget). The reconciler applies the plan
(terminates, registers with the leaderboard, creates, records the events), so every decision
here is tested without either (tests/orchestrator/test_scaling.py).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from services.contracts.spec import ExperimentSpec
from services.orchestrator.backends.base import PodInfo
from services.orchestrator.scheduler import Res, assign_algorithms, launchable, scale_in
from services.orchestrator.status import ExperimentStatus
from services.orchestrator.store import BUDGET_EXHAUSTED


@dataclass(frozen=True)
class ScalePlan:
    target: int
    #: Pods to stop gracefully (scale in): newest first, or with successive halving the worst
    #: first.
    stop: list[str] = field(default_factory=list)
    #: Why each of ``stop`` is stopped (its event's message).
    stop_reasons: dict[str, str] = field(default_factory=dict)
    #: One entry per pod to create: its ensemble algorithm (None: a single algorithm).
    create: list[str | None] = field(default_factory=list)
    #: Env steps each created pod may take (``PODIUM_MAX_ENV_STEPS``); None: no budget.
    allowance: int | None = None
    #: Why fewer pods than the target are launched (shown as the experiment's reason).
    reason: str | None = None
    #: When a launch held back now may happen (epoch seconds): the loop wakes then.
    wake_at: float | None = None
    #: The experiment is over: (state, reason).
    end: tuple[str, str] | None = None


def env_steps_left(
    spec: ExperimentSpec, status: ExperimentStatus, live: Collection[str]
) -> int | None:
    """What is left of the env-step budget for pods not started yet (None without one): the
    total, minus what the pods no longer alive reported, minus the allowances of those alive,
    stopping ones too (counted whole, their reports so far with them; in whole batches where
    every pod trains the same batch, since a pod trains whole batches only and what is left of
    its allowance below one comes back when it ends). Before the submission log was read, the
    leaderboard's count stands for what was reported: live pods' reports count twice."""
    total = spec.budget.total_env_steps
    if total is None:
        return None
    unit = status.batch_env_steps if status.batch_uniform and status.batch_env_steps else 1
    committed = sum(v // unit * unit for k, v in status.allowances.items() if k in live)
    spent = status.env_steps or 0
    if status.logged_env_steps is not None:
        spent = status.logged_env_steps - sum(n for k, n in status.reported.items() if k in live)
    return total - spent - committed


def env_step_allowance(
    spec: ExperimentSpec,
    status: ExperimentStatus,
    active: Collection[str],
    target: int,
    left: int | None = None,
) -> int | None:
    """Env steps each pod started now may take (``PODIUM_MAX_ENV_STEPS``); None without an
    env-step budget, <= 0 when running pods hold all that is left.

    What is left (``env_steps_left``) is split evenly over the pods still to start toward the
    target, in whole units of a pod's batch (``status.batch_env_steps``) once it is known: a
    pod trains whole batches only, so a share that is not a whole number of batches leaves the
    rest untrained, and a share below one batch trains nothing. Fewer batches left than pods
    to start go to one pod: a pod's start (an interpreter, torch, maybe a compile) costs far
    more than a batch, so spreading the last batches one a pod would only multiply starts. The
    pods alive at once can never take more than the budget together; a pod cuts its round at
    its allowance, reports and exits 0, and its replacement gets a share of what is left.
    ``left``: what ``env_steps_left`` returns, where the caller has it already.
    """
    if left is None:
        left = env_steps_left(spec, status, active)
    if left is None:
        return None
    sharing = max(1, target - sum(1 for k in active if k in status.allowances))
    unit = status.batch_env_steps or 1
    batches = left // unit
    if batches <= 0:
        return 0
    # Fewer pods with whole batches beat more pods with one, or none, each.
    return (batches // sharing or batches) * unit


_FREE = "pod stopped to free capacity"


def _halve(
    spec: ExperimentSpec, active: list[PodInfo], target: int, scores: Mapping[str, float]
) -> ScalePlan:
    """Successive halving's scale-in: the pods whose last scores rank below the best
    ``target`` stop, worst first. A pod that has not reported yet is ranked once it has: a
    scored pod stops now only if ``target`` scored pods beat it already (whatever the others
    report, it is out); the rest of the cut waits for their reports. The ensemble's shares
    do not count, the scores do."""
    sign = 1.0 if spec.evaluation.higher_is_better else -1.0
    scored = sorted(
        (p for p in active if p.pod_id in scores),
        key=lambda p: (sign * scores[p.pod_id], p.created_at),  # a tie: the older stays
        reverse=True,
    )
    out = scored[target:][::-1][: len(active) - target]
    reasons = {
        p.pod_id: f"pod stopped by successive halving: last score {scores[p.pod_id]:.4g}, "
        f"not among the best {target}"
        for p in out
    }
    unscored = len(active) - len(scored)
    reason = None
    if len(out) < len(active) - target:
        reason = f"successive halving: waiting for {unscored} pods' first report to rank them"
    return ScalePlan(target, stop=[p.pod_id for p in out], stop_reasons=reasons, reason=reason)


def plan_scale(
    spec: ExperimentSpec,
    status: ExperimentStatus,
    live: list[PodInfo],
    target: int,
    per_pod: Res,
    free: Res,
    now: float,
    scores: Mapping[str, float] | None = None,
) -> ScalePlan:
    """``scores``: each live pod's last score, when successive halving sets ``target``: it
    stops the worst first."""
    active = sorted((p for p in live if not p.terminating), key=lambda p: p.created_at)
    if len(active) > target:
        # SIGTERM lets each report before exiting.
        if scores is not None:
            return _halve(spec, active, target, scores)
        # Newest first: they have trained least; in an ensemble, of the algorithm furthest
        # above its share.
        running = [p.algorithm for p in active]
        stop = [active[i].pod_id for i in scale_in(spec.algorithms, running, len(active) - target)]
        return ScalePlan(target, stop=stop, stop_reasons=dict.fromkeys(stop, _FREE))
    if len(active) == target:
        return ScalePlan(target)
    wait = (status.next_launch_at or 0.0) - now
    if wait > 0:
        reason = f"backing off {wait:.1f}s after a pod failure"
        return ScalePlan(target, reason=reason, wake_at=status.next_launch_at)
    n = launchable(target, len(active), per_pod, free)
    budget = spec.budget.pods_launched
    if budget is not None:
        n = min(n, max(0, budget - status.pods_launched))
        if n == 0 and status.pods_launched >= budget:
            return ScalePlan(target, reason=f"pod budget reached ({budget} launched)")
    ids = {p.pod_id for p in active}
    # A pod still stopping makes a final report: the allowance it holds stays its own.
    left = env_steps_left(spec, status, {p.pod_id for p in live})
    allowance = env_step_allowance(spec, status, ids, target, left)
    left = left or 0
    if allowance is not None and allowance <= 0:
        unit = status.batch_env_steps
        if unit and not live and left < unit:
            # Nothing running and no pod could train a step of what is left: launching one
            # would only see it report nothing and exit (and be replaced, again and again).
            why = f"env-step budget spent: {left} steps left, below one batch of {unit}"
            return ScalePlan(target, end=(BUDGET_EXHAUSTED, why))
        if n:
            return ScalePlan(target, reason="the env-step budget left is held by the running pods")
    if allowance is not None and status.batch_env_steps:
        # Only as many pods as there are whole batches left to give them.
        n = min(n, left // allowance)
    running = [p.algorithm for p in active]
    return ScalePlan(
        target, create=assign_algorithms(spec.algorithms, running, n), allowance=allowance
    )
