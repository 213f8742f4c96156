"""The level-triggered reconcile loop: desired (experiments in Redis) vs observed (pods).

Every pass reads the whole desired state and the whole observed state and acts on the
difference, so it is idempotent and restart-safe: a new orchestrator lists the pods it finds by
label and adopts them (never starts duplicates), and terminates pods no experiment wants
(never leaves orphans). A pass:

1. Hands in finished pods once each (``Store.mark_handled``): a failure raises the experiment's
   consecutive-failure count and schedules the replacement after an exponential backoff; too
   many consecutive failures fail the experiment with the last reason and log lines.
2. Reads progress from the leaderboard and ends experiments at their target return, budget,
   cancel or pause (every pod gets SIGTERM, reports, then exits).
3. Allocates capacity with ``scheduler.allocate`` (strict priority, min pods or nothing, fair
   share) and creates or gracefully terminates pods toward each target.

The loop wakes on a timer and whenever the backend reports a pod change, so a dead pod is
replaced within milliseconds rather than a full interval.

Why one file of this size: one pass reads top-down (end, replace, scale) as the level-
triggered loop it is; its pure scheduling maths is in scheduler.py and its leaderboard calls
in progress_calls.py already.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from services.api_client import ServiceError
from services.contracts.spec import ExperimentSpec, halving_pods
from services.logs import get_logger
from services.orchestrator import metrics
from services.orchestrator import store as st
from services.orchestrator.backends.base import BAD_INPUT_EXIT, Backend, PodInfo, PodRequest
from services.orchestrator.leaderboard_client import Progress, ProgressSource
from services.orchestrator.progress_calls import ProgressCalls, make_breaker
from services.orchestrator.scaling import ScalePlan, plan_scale
from services.orchestrator.scheduler import Demand, Res, allocate, backoff_delay
from services.orchestrator.settings import OrchestratorSettings
from services.orchestrator.status import (
    EndedPodLog,
    ExperimentResult,
    ExperimentStatus,
    LastFailure,
    PodStatus,
)
from services.orchestrator.store import Experiment, Store

log = get_logger(__name__)

#: How long a new pod of an experiment with an env-step budget waits for the leaderboard to
#: count the steps of the pods that just ended (its allowance is computed from that count).
STEPS_SETTLE_S = 2.0
#: Lines of a failed pod's log in its experiment's ``last_failure``.
FAILURE_TAIL_LINES = 5


def pod_resources(spec: ExperimentSpec) -> Res:
    return Res(spec.resources.cpu, spec.resources.gpus, spec.resources.memory_bytes)


def last_lines(text: str, n: int) -> str:
    """The last ``n`` lines of ``text``."""
    return "\n".join(text.splitlines()[-n:])


def last_bytes(text: str, limit: int) -> str:
    """The end of ``text``, at most ``limit`` bytes of UTF-8, starting at a whole line."""
    data = text.encode()
    if len(data) <= limit:
        return text
    tail = data[-limit:].decode(errors="ignore")
    return tail.partition("\n")[2] if "\n" in tail else tail


def failure_line(tail: str) -> str | None:
    """The line of a failed pod's log tail worth putting in a reason: its last line, unless it
    is an ordinary info/debug line (a pod killed from outside dies mid-sentence of its normal
    log). A JSON log line gives its event and error."""
    lines = [x for x in tail.splitlines() if x.strip()]
    if not lines:
        return None
    line = lines[-1].strip()
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if isinstance(record, dict):
        if str(record.get("level", "")).lower() in ("debug", "info"):
            return None
        event, error = record.get("event"), record.get("error")
        return ": ".join(str(x) for x in (event, error) if x) or line
    if re.match(r"^\S*\s*(?:\[?(?:INFO|DEBUG)\]?)[\s:]", line):
        return None
    return line


class Reconciler:
    def __init__(
        self,
        settings: OrchestratorSettings,
        store: Store,
        backend: Backend,
        progress: ProgressSource,
    ):
        self.settings = settings
        self.store = store
        self.backend = backend
        self.calls = ProgressCalls(
            progress,
            settings.leaderboard_concurrency,
            make_breaker(
                settings.leaderboard_breaker_failures, settings.leaderboard_breaker_reset_s
            ),
            self.wake,
            min_retry_s=max(0.1, settings.progress_poll_s),
            max_retry_s=settings.leaderboard_breaker_reset_s,
        )
        self._final_since: dict[str, float] = {}  # experiment → when its last pod was gone
        self._ended_at: dict[str, float] = {}  # experiment → when a pod of it last ended
        self._next_launch: float | None = None  # the earliest backoff end seen in a pass
        self._created: dict[str, list[PodInfo]] = {}  # pods created this pass, per experiment
        self._creates_left = settings.create_per_pass  # pods this pass may still create
        self._pool = ThreadPoolExecutor(settings.create_concurrency, thread_name_prefix="create")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.passes = 0
        self.last_error: str | None = None
        self.failed_passes = 0  # consecutive; /readyz reports a reconciler that keeps failing
        self._invalid_seen: set[str] = set()

    # -- loop --------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="reconciler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.backend.changed.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._pool.shutdown(wait=True)
        self.calls.close()

    def wake(self) -> None:
        self.backend.changed.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.backend.changed.clear()
            try:
                with metrics.RECONCILE_SECONDS.time():
                    self.reconcile_once()
                self.last_error = None
                self.failed_passes = 0
            except Exception as e:  # keep looping: the next pass starts from observed state
                metrics.RECONCILE_ERRORS.inc()
                self.last_error = f"{type(e).__name__}: {e}"
                self.failed_passes += 1
                log.exception("reconcile pass failed")
            wait = self.settings.reconcile_interval_s
            if self._next_launch is not None:  # a backoff ends before the next timed pass
                wait = min(wait, max(0.0, self._next_launch - time.time()))
            self.backend.changed.wait(wait)

    # -- one pass ----------------------------------------------------------------------------
    def reconcile_once(self) -> None:
        now = time.time()
        self._next_launch = None
        self._creates_left = self.settings.create_per_pass
        # Only experiments with work left (not ended and finalized): finished ones cost nothing.
        exps: dict[str, Experiment] = {}
        invalid: dict[str, Experiment] = {}
        for e in self.store.active():
            (invalid if e.invalid else exps)[e.id] = e
        pods = self.backend.list_pods()
        by_exp: dict[str, list[PodInfo]] = defaultdict(list)
        for p in pods:
            by_exp[p.experiment_id].append(p)
        self._skip_invalid(invalid, by_exp)

        for exp_id, ps in by_exp.items():
            if exp_id not in exps and exp_id not in invalid:  # orphans: nobody wants them
                for p in ps:
                    if p.live:
                        self._terminate(p, None)
                    else:
                        self.backend.remove_pod(exp_id, p.pod_id)

        statuses: dict[str, ExperimentStatus] = {}
        demands: list[Demand] = []
        for exp in exps.values():
            ps = by_exp.get(exp.id, [])
            status = exp.status.model_copy(deep=True)
            self._hand_in_finished(exp, ps, status, now)
            live = [p for p in ps if p.live]
            if exp.intent == st.DELETE:
                self._stop_all(exp, live)
                if not live:
                    self._delete(exp)
                continue
            self._adopt(exp, status, live)
            self._check_end(exp, status, now, live)
            if status.state in st.TERMINAL or status.state == st.PAUSED:
                status.desired_pods = 0  # it wants none now ("0 running, 2 wanted" was wrong)
                self._stop_all(exp, live)
                self._finalize(exp, status, live)
                self._save(exp, status, ps)
                continue
            statuses[exp.id] = status
            spec = exp.spec
            # Successive halving: fewer pods wanted at each rung (their capacity freed for
            # other experiments).
            most = spec.population.max_pods
            most = min(most, halving_pods(spec.population, status.env_steps) or most)
            demands.append(
                Demand(
                    experiment_id=exp.id,
                    priority=spec.priority,
                    created_at=exp.created_at,
                    min_pods=min(spec.population.min_pods, most),
                    max_pods=most,
                    per_pod=pod_resources(spec),
                )
            )

        capacity = self.backend.capacity()
        alloc = allocate(demands, capacity)
        used = Res()
        for p in pods:
            if p.live:
                used = used + p.resources
        free = capacity - used

        for d in sorted(demands, key=lambda d: (-d.priority, d.created_at)):
            exp, status = exps[d.experiment_id], statuses[d.experiment_id]
            live = [p for p in by_exp.get(exp.id, []) if p.live]
            free, why = self._scale(exp, status, live, alloc.pods[exp.id], d.per_pod, free)
            created = self._created.pop(exp.id, [])
            ps = by_exp.get(exp.id, []) + created
            if status.state in st.TERMINAL:  # ended while scaling (the budget, the leaderboard)
                self._stop_all(exp, [p for p in ps if p.live])
                self._save(exp, status, ps)
                continue
            active = [p for p in live if not p.terminating]
            reason = why or alloc.pending_reason.get(exp.id)
            if active or any(p.live for p in created):
                status.state, status.reason = st.RUNNING, reason
                if status.started_at is None:
                    status.started_at = now
            else:
                status.state = st.PENDING
                status.reason = reason or "starting pods"
            self._save(exp, status, ps)

        self._update_gauges(pods)
        self.passes += 1

    # -- pieces ------------------------------------------------------------------------------
    def _skip_invalid(
        self, invalid: dict[str, Experiment], by_exp: dict[str, list[PodInfo]]
    ) -> None:
        """A stored record that no longer validates is left alone (its pods too), counted
        and logged once, so it cannot stop the pass for every other experiment; deleting it
        through the API still works."""
        metrics.INVALID_EXPERIMENTS.set(len(invalid))
        for exp in invalid.values():
            live = [p for p in by_exp.get(exp.id, []) if p.live]
            if exp.intent == st.DELETE:
                for p in live:
                    if not p.terminating:
                        self._terminate(p, exp.id, keep_log=False)
                if not live:
                    self._delete(exp)
            elif exp.id not in self._invalid_seen:
                log.error("invalid stored experiment skipped", experiment=exp.id, why=exp.invalid)
        self._invalid_seen = set(invalid)

    def _hand_in_finished(
        self, exp: Experiment, ps: list[PodInfo], status: ExperimentStatus, now: float
    ) -> None:
        # A pod started after the last failure that has stayed up long enough proves the
        # experiment is not crash-looping (older pods prove nothing about the replacements).
        healthy_after = self.settings.pod_healthy_after_s
        # (1 s of slack: Kubernetes creation timestamps have whole-second resolution.)
        since = (status.last_failure_at or 0.0) - 1.0
        if status.consecutive_failures and any(
            p.live and p.created_at > since and now - p.created_at >= healthy_after for p in ps
        ):
            status.consecutive_failures = 0
        for p in ps:
            if p.live:
                continue
            # Its log is kept before the pod is marked handled, so that a crash or a failed log
            # read in between leaves the whole hand-in to the next pass (keeping it again writes
            # the same record); and before the backend forgets the pod (and its log). Only
            # while it is not handled: a handed-in pod listed again (Kubernetes' watch shows it
            # once more while it is deleted, terminating, its log gone) would overwrite its
            # record with an empty "stopped" one. Nobody asks for a deleted experiment's logs.
            first = not self.store.handled(exp.id, p.pod_id)
            tail = self._keep_log(exp.id, p) if first and exp.intent != st.DELETE else ""
            if first and self.store.mark_handled(exp.id, p.pod_id):
                if exp.spec.budget.total_env_steps is not None:
                    self._ended_at[exp.id] = time.monotonic()  # see _steps_counted
                ended = status.state in st.TERMINAL  # possibly earlier in this pass
                if p.terminating:
                    self.store.event(exp.id, "pod_stopped", f"pod stopped ({p.reason})", p.pod_id)
                elif p.phase == "Failed" and ended:
                    self.store.event(exp.id, "pod_failed", f"pod failed: {p.reason}", p.pod_id)
                elif p.phase == "Failed":
                    self._pod_failed(exp, p, status, now, tail)
                else:
                    if not ended:
                        status.consecutive_failures = 0
                    self.store.event(exp.id, "pod_completed", "pod finished", p.pod_id)
            self.backend.remove_pod(exp.id, p.pod_id)

    def _adopt(self, exp: Experiment, status: ExperimentStatus, live: list[PodInfo]) -> None:
        """Record the live pods that no orchestrator recorded: a previous one (killed in the
        pass that created them, after the pods started and before the pass saved its status)
        started them. Each gets its start event, once (``Store.pod_launched``), and the launch
        count and start time are made good. A pod that the stored status lists (every live pod of
        the last pass that saved) is known already; the store is asked about the rest only."""
        # Launches recorded (each with its event) by a pass that died before saving its status.
        status.pods_launched = max(status.pods_launched, exp.launched)
        saved = {p.pod_id for p in exp.status.pods}
        for p in live:
            if p.pod_id in saved:
                continue
            if self._record_launch(exp, status, p.pod_id, p.algorithm, adopted=True):
                status.pods_launched += 1
                log.warning("unrecorded pod adopted", experiment=exp.id, pod=p.pod_id)
        if status.started_at is None and live:
            status.started_at = min(p.created_at for p in live)

    def _record_launch(
        self,
        exp: Experiment,
        status: ExperimentStatus,
        pod_id: str,
        algorithm: str | None,
        adopted: bool = False,
    ) -> bool:
        """Record a pod's launch and its event (started, or the replacement of the next failed
        pod waiting for one): True the first time, False when it was recorded already."""
        trains = f" ({algorithm})" if algorithm else ""
        found = " (found running after an orchestrator restart)" if adopted else ""
        if status.to_replace:
            kind, why = "pod_replaced", f"replaces failed pod {status.to_replace[0]}{trains}"
        else:
            kind, why = "pod_started", f"pod started{trains}"
        if not self.store.pod_launched(exp.id, pod_id, kind, why + found):
            return False
        if status.to_replace:
            status.to_replace = status.to_replace[1:]
        return True

    def _keep_log(self, exp_id: str, p: PodInfo) -> str:
        """An ended pod's last log lines, kept with its experiment (``ended_pod_logs`` pods at
        most) so that they outlive the pod: `podium logs` of an ended experiment shows them."""
        s = self.settings
        if not s.ended_pod_logs:
            if p.phase != "Failed":
                return ""
            return self.backend.pod_log_tail(exp_id, p.pod_id, lines=FAILURE_TAIL_LINES)
        tail = self.backend.pod_log_tail(exp_id, p.pod_id, lines=s.ended_pod_log_lines)
        record = EndedPodLog(
            pod_id=p.pod_id,
            phase=p.phase,
            stopped=p.terminating,
            reason=p.reason,
            algorithm=p.algorithm,
            ended_at=time.time(),
            log=last_bytes(tail, s.ended_pod_log_bytes),
        )
        self.store.keep_pod_log(exp_id, record, s.ended_pod_logs)
        return tail

    def _pod_failed(
        self, exp: Experiment, p: PodInfo, status: ExperimentStatus, now: float, log_tail: str
    ) -> None:
        metrics.PODS_FAILED.inc()
        tail = last_lines(log_tail, FAILURE_TAIL_LINES)
        last = p.reason or "failed"
        line = failure_line(tail)
        status.last_failure = LastFailure(pod_id=p.pod_id, reason=last, log_tail=tail)
        if p.exit_code == BAD_INPUT_EXIT:
            # The pod said its input can never work: another pod would say the same.
            why = line or last
            self.store.event(exp.id, "pod_failed", f"pod refused its input: {why}", p.pod_id)
            self._end(exp, status, st.FAILED, f"a pod refused its input (exit code 2): {why}", now)
            return
        status.to_replace = [*status.to_replace, p.pod_id]
        # An outside stop (eviction, preemption, a node lost, a kill) of a pod that had done
        # its work is not a crash loop: replaced at once and not counted.
        if p.disruption or self.calls.reported(exp.id, p.pod_id):
            status.consecutive_failures = 0
            status.next_launch_at = None
            why = p.disruption or "it had reported to the leaderboard"
            self.store.event(
                exp.id,
                "pod_failed",
                f"pod failed: {last}; replacing now (not counted as a crash: {why})",
                p.pod_id,
            )
            log.warning("pod stopped from outside", experiment=exp.id, pod=p.pod_id, why=why)
            return
        # A pod that ran long enough before failing starts a new count: it was not crash-looping.
        young = now - p.created_at < self.settings.pod_healthy_after_s
        n = status.consecutive_failures + 1 if young else 1
        status.consecutive_failures = n
        delay = backoff_delay(n, self.settings.backoff_initial_s, self.settings.backoff_max_s)
        status.next_launch_at = now + delay
        status.last_failure_at = now
        self.store.event(
            exp.id,
            "pod_failed",
            f"pod failed: {last}; replacing in {delay:.2f}s ({n} consecutive failures)",
            p.pod_id,
        )
        log.warning("pod failed", experiment=exp.id, pod=p.pod_id, reason=last, failures=n)
        if n >= self.settings.crash_loop_limit:
            self._end(
                exp,
                status,
                st.FAILED,
                f"pods keep crashing: {n} consecutive failures; last: {last}"
                + (f": {line}" if line else ""),
                now,
            )

    def _record_progress(self, exp: Experiment, status: ExperimentStatus, prog: Progress) -> None:
        if prog.best is not None:
            status.best = prog.best
        if prog.env_steps is not None:
            status.env_steps = prog.env_steps
        if exp.spec.budget.total_env_steps is not None and prog.env_steps is not None:
            # What the pods that ended spent, for the budget's split (scaling.env_steps_left).
            status.logged_env_steps = sum(prog.reported.values())
            status.reported = {pod: prog.reported.get(pod, 0) for pod in status.allowances}
        batch = self.calls.batch(exp.id)
        if batch is not None:  # per agent in the reports; a pod steps all its agents at once
            status.batch_env_steps = batch * exp.spec.population.agents_per_pod
            status.batch_uniform = self.calls.batch_is_uniform(exp.id)

    def _check_end(
        self, exp: Experiment, status: ExperimentStatus, now: float, live: list[PodInfo]
    ) -> None:
        state = status.state
        if state in st.TERMINAL:
            return
        if exp.intent == st.CANCEL:
            self._end(exp, status, st.CANCELLED, "cancelled by request", now)
            return
        if exp.intent == st.PAUSE:
            if state != st.PAUSED:
                status.state, status.reason = st.PAUSED, "paused by request"
                self.store.event(exp.id, "paused", "experiment paused; stopping its pods")
            return
        if state == st.PAUSED:  # intent is run again
            status.state, status.reason = st.PENDING, "resumed"
            self.store.event(exp.id, "resumed", "experiment resumed")
        spec = exp.spec
        if not status.registered and live:
            # Pods run only once the experiment is registered: a previous orchestrator was
            # killed in the pass that registered it and created them, before it saved that.
            # Registered again (the same configuration: the leaderboard answers 200), so the
            # progress of the pods adopted is read; else nothing would ever register it (only
            # a pass that creates pods does) and the target would never be seen.
            self._register(exp, status)
            if status.state in st.TERMINAL:  # the leaderboard refused it
                return
        if status.registered:
            # The last known progress: a pass never waits on the leaderboard.
            pods = [p.pod_id for p in live]
            # The submission log: the batch a budget's allowances are counted in, the scores
            # successive halving ranks the pods by.
            read_log = (
                spec.budget.total_env_steps is not None or spec.population.halving is not None
            )
            prog, _ = self.calls.progress(
                exp.id, self.settings.progress_poll_s, pods=pods, read_log=read_log
            )
            self._record_progress(exp, status, prog)
        # The target first: met, the experiment succeeded whatever else ran out meanwhile.
        score = self._target_met(exp, status)
        if score is not None:
            target = spec.target_return
            self.store.event(
                exp.id, "target_reached", f"best score {score:g} reached target {target:g}"
            )
            self._end(exp, status, st.SUCCEEDED, f"target return {target:g} reached", now)
            return
        budget = spec.budget
        steps = status.env_steps
        if budget.total_env_steps is not None and (steps or 0) >= budget.total_env_steps:
            self._end(
                exp,
                status,
                st.BUDGET_EXHAUSTED,
                f"env-step budget spent: {steps} >= {budget.total_env_steps}",
                now,
            )
            return
        started = status.started_at
        if budget.wall_time_s is not None and now - (started or now) >= budget.wall_time_s:
            self._end(
                exp,
                status,
                st.BUDGET_EXHAUSTED,
                f"wall-time budget spent: {budget.wall_time_s:g}s",
                now,
            )
            return
        launched = status.pods_launched
        if budget.pods_launched is not None and launched >= budget.pods_launched and not live:
            self._end(
                exp,
                status,
                st.BUDGET_EXHAUSTED,
                f"pod budget spent: {launched} pods launched and all have ended",
                now,
            )

    def _target_met(self, exp: Experiment, status: ExperimentStatus) -> float | None:
        """The best score when it meets the spec's target return, else None."""
        spec = exp.spec
        score = status.best_score
        target = spec.target_return
        if target is None or score is None:
            return None
        reached = score >= target if spec.evaluation.higher_is_better else score <= target
        return float(score) if reached else None

    def _target_met_at_the_end(self, exp: Experiment, status: ExperimentStatus) -> None:
        """A budget ran out while the report that met the target was still on its way (the
        final reports come in after the end): the experiment met its target, so it says so."""
        if status.state != st.BUDGET_EXHAUSTED:
            return
        score = self._target_met(exp, status)
        if score is not None:
            target = exp.spec.target_return
            self.store.event(
                exp.id, "target_reached", f"best score {score:g} reached target {target:g}"
            )
            status.state, status.reason = st.SUCCEEDED, f"target return {target:g} reached"
            self.store.event(exp.id, st.SUCCEEDED, status.reason)

    def _end(
        self, exp: Experiment, status: ExperimentStatus, state: str, reason: str, now: float
    ) -> None:
        status.state, status.reason = state, reason
        status.finished_at, status.finalized = now, False
        self.store.event(exp.id, state, reason)
        log.info("experiment ended", experiment=exp.id, state=state, reason=reason)

    def _finalize(self, exp: Experiment, status: ExperimentStatus, live: list[PodInfo]) -> None:
        """After the end, keep reading progress until the pods' final reports are in."""
        if status.state not in st.TERMINAL or status.finalized:
            return
        since = None
        if not live:
            since = self._final_since.setdefault(exp.id, time.monotonic())
        settled = True
        if status.registered:
            # Once the last pod is gone, one answer asked after that (so its final report
            # counts), or a failure to get one.
            prog, settled = self.calls.progress(exp.id, self.settings.progress_poll_s, since)
            self._record_progress(exp, status, prog)
            self._target_met_at_the_end(exp, status)
        if not live and settled:
            status.finalized = True
            status.result = ExperimentResult(
                state=status.state,
                reason=status.reason,
                best=status.best,
                env_steps=status.env_steps,
                pods_launched=status.pods_launched,
                finished_at=status.finished_at,
            )
            self._final_since.pop(exp.id, None)
            self._ended_at.pop(exp.id, None)
            self.calls.forget(exp.id)

    def _stop_all(self, exp: Experiment, live: list[PodInfo]) -> None:
        for p in live:
            if not p.terminating:
                self._terminate(p, exp.id, keep_log=exp.intent != st.DELETE)

    def _terminate(self, p: PodInfo, exp_id: str | None, keep_log: bool = True) -> None:
        if keep_log and exp_id and self.backend.forgets_stopped_pods and p.phase == "Running":
            # Its lines up to the stop: this backend's pod may be gone, log and all, before a
            # pass sees it ended (then its record is replaced by the full one). Best effort:
            # a log that cannot be read or kept never delays the stop.
            try:
                self._keep_log(exp_id, dataclasses.replace(p, terminating=True))
            except Exception as e:
                log.warning("pod log not kept", experiment=exp_id, pod=p.pod_id, error=str(e))
        self.backend.terminate_pod(p.experiment_id, p.pod_id, self.settings.termination_grace_s)
        p.terminating = True
        metrics.PODS_TERMINATED.inc()
        if exp_id is None:
            log.info("orphan pod stopped", experiment=p.experiment_id, pod=p.pod_id)

    def _scale(
        self,
        exp: Experiment,
        status: ExperimentStatus,
        live: list[PodInfo],
        target: int,
        per_pod: Res,
        free: Res,
    ) -> tuple[Res, str | None]:
        """Plan (scaling.plan_scale) and apply: the free capacity left, and why fewer pods than
        the target run (None: no reason of this experiment's own)."""
        spec = exp.spec
        halving = halving_pods(spec.population, status.env_steps)
        if target != status.desired_pods:
            why = "capacity and priority"
            if halving is not None and target == halving < spec.population.max_pods:
                steps = status.env_steps or 0
                why = f"successive halving at {steps:,} env steps: the best {target}"
            message = f"desired pods {status.desired_pods} -> {target} ({why})"
            self.store.event(exp.id, "scaled", message)
            status.desired_pods = target
        scores = None
        if halving is not None and target == halving:  # a rung's cut stops the worst pods
            higher = spec.evaluation.higher_is_better
            scores = self.calls.pod_scores(exp.id, (p.pod_id for p in live), higher)
        # The time now, not the pass's start: a backoff that ended during a slow pass does not
        # wait for another pass (and the loop wakes when the earliest backoff ends).
        plan = plan_scale(spec, status, live, target, per_pod, free, time.time(), scores)
        if plan.create or plan.end:
            # New pods' allowances (and an end for a budget spent) need the ended pods' steps
            # counted: wait for that, then plan again with the count.
            waiting = self._steps_counted(exp, status)
            if waiting:
                return free, waiting
            plan = plan_scale(spec, status, live, target, per_pod, free, time.time(), scores)
        return self._apply(exp, status, plan, live, per_pod, free)

    def _apply(
        self,
        exp: Experiment,
        status: ExperimentStatus,
        plan: ScalePlan,
        live: list[PodInfo],
        per_pod: Res,
        free: Res,
    ) -> tuple[Res, str | None]:
        """The plan's side effects: pods stopped or created, events; see ``_scale``."""
        if plan.wake_at is not None:
            self._wake_at(plan.wake_at)
        if plan.end is not None:
            self._end(exp, status, *plan.end, time.time())
            return free, None
        by_id = {p.pod_id: p for p in live}
        for pod_id in plan.stop:
            self._terminate(by_id[pod_id], exp.id)
            self.store.event(exp.id, "pod_scaled_in", plan.stop_reasons[pod_id], pod_id)
        if not plan.create:
            active = sum(1 for p in live if not p.terminating)
            if plan.reason is None and active < plan.target:
                return free, f"{active}/{plan.target} pods; waiting for resources to be released"
            return free, plan.reason
        registering = self._register(exp, status)
        if registering:
            return free, registering
        # At most ``create_per_pass`` creates per pass, the rest by the next pass, at once: one
        # pass creating 1,000 pods took 2-5 s, and nothing else was reconciled meanwhile.
        bounded = len(plan.create) > self._creates_left
        if bounded:
            plan = dataclasses.replace(plan, create=plan.create[: self._creates_left])
        created, failure = self._create(exp, status, plan, per_pod) if plan.create else (0, None)
        if bounded and failure is None:  # after a failed create, the timer: no retry storm
            self._wake_at(time.time())
        free = free - per_pod.times(created)
        active = sum(1 for p in live if not p.terminating) + created
        if failure is None and active < plan.target:
            rest = "creating the rest" if bounded else "waiting for resources to be released"
            failure = f"{active}/{plan.target} pods; {rest}"
        return free, failure

    def _create(
        self, exp: Experiment, status: ExperimentStatus, plan: ScalePlan, per_pod: Res
    ) -> tuple[int, str | None]:
        """Create the plan's pods; how many were created, and why creating failed (if so)."""
        self._creates_left -= len(plan.create)
        spec_json = exp.spec.model_dump_json()
        env = self._pod_env()
        if plan.allowance is not None:
            env["PODIUM_MAX_ENV_STEPS"] = str(plan.allowance)
        # An ensemble's pods are each told their algorithm, so every algorithm keeps its
        # share of the running pods (the generator keeps a pod on it when PBT exploits).
        reqs = [
            PodRequest(
                experiment_id=exp.id,
                pod_id=secrets.token_hex(4),
                spec_json=spec_json,
                resources=per_pod,
                env=env,
                grace_s=self.settings.termination_grace_s,
                algorithm=algorithm,
            )
            for algorithm in plan.create
        ]
        # Creates are independent API calls (or fork/execs): issue them concurrently, since
        # against a real API server each one is a round trip.
        futures = [self._pool.submit(self.backend.create_pod, req) for req in reqs]
        created, failure = 0, None
        for req, fut in zip(reqs, futures, strict=True):
            try:
                fut.result()
            except Exception as e:
                log.warning("pod create failed", experiment=exp.id, pod=req.pod_id, error=str(e))
                failure = f"creating pods failed: {type(e).__name__}: {e}"
                continue
            created += 1
            metrics.PODS_CREATED.inc()
            status.pods_launched += 1
            if plan.allowance is not None:
                status.allowances = {**status.allowances, req.pod_id: plan.allowance}
            pod = PodInfo(
                exp.id, req.pod_id, "Pending", time.time(), per_pod, algorithm=req.algorithm
            )
            self._created.setdefault(exp.id, []).append(pod)
            self._record_launch(exp, status, req.pod_id, req.algorithm)
        return created, failure

    def _wake_at(self, at: float) -> None:
        """The loop runs a pass by ``at`` (epoch seconds) at the latest."""
        self._next_launch = at if self._next_launch is None else min(self._next_launch, at)

    def _steps_counted(self, exp: Experiment, status: ExperimentStatus) -> str | None:
        """None once the env steps of the experiment's ended pods are in the count that new
        pods' allowances are computed from (a leaderboard answer asked after the last pod
        ended: a pod exits after its final report is acknowledged); else why a launch waits.
        Waited for at most ``STEPS_SETTLE_S``, so a leaderboard that does not answer delays a
        replacement by that much only (then the last known count is used)."""
        ended = self._ended_at.get(exp.id)
        if ended is None or not status.registered:
            return None
        # With the submission log read (``batches``): the ended pods' reports hold the batch
        # that the new pods' allowances are counted in.
        prog, settled = self.calls.progress(
            exp.id, self.settings.progress_poll_s, since=ended, read_log=True
        )
        self._record_progress(exp, status, prog)
        left = ended + STEPS_SETTLE_S - time.monotonic()
        if settled or left <= 0:
            self._ended_at.pop(exp.id, None)
            return None
        self._wake_at(time.time() + left)
        return "waiting for the leaderboard to count the ended pods' steps"

    def _register(self, exp: Experiment, status: ExperimentStatus) -> str | None:
        """None once the experiment is registered with the leaderboard; else why pods wait
        (the experiment is failed when the leaderboard refuses it)."""
        if status.registered:
            return None
        try:
            done = self.calls.register(exp.id, exp.spec)
        except ServiceError as e:
            if e.status is None or e.status >= 500:
                return f"leaderboard unavailable: {e}"
            # A 4xx is the leaderboard refusing this experiment: retrying cannot help.
            self._end(
                exp,
                status,
                st.FAILED,
                f"the leaderboard refused the experiment ({e.status}): {str(e.detail)[:500]}",
                time.time(),
            )
            return status.reason
        except Exception as e:
            return f"leaderboard unavailable: {e}"
        if not done:
            return "registering the experiment with the leaderboard"
        status.registered = True
        return None

    def _pod_env(self) -> dict[str, str]:
        env = {
            **self.settings.pod_env,  # an operator's: none of the names below (its validator)
            # The pod budgets its final report (retries included) inside the grace period
            # (the PodRequest's grace_s, which the backend enforces).
            "PODIUM_TERMINATION_GRACE_S": f"{self.settings.termination_grace_s:g}",
        }
        if self.settings.leaderboard_url:
            env["PODIUM_LEADERBOARD_URL"] = self.settings.leaderboard_url
        token = self.settings.leaderboard_token_value()
        if token:
            env["PODIUM_API_TOKEN"] = token
        return env

    def _save(self, exp: Experiment, status: ExperimentStatus, ps: list[PodInfo]) -> None:
        if status.allowances:  # held by live pods only
            live = {p.pod_id for p in ps if p.live}
            status.allowances = {k: v for k, v in status.allowances.items() if k in live}
            status.reported = {k: v for k, v in status.reported.items() if k in live}
        status.pods = [
            PodStatus(
                pod_id=p.pod_id,
                phase="Terminating" if p.live and p.terminating else p.phase,
                created_at=p.created_at,
                reason=p.reason,
                algorithm=p.algorithm,
            )
            for p in ps
            if p.live
        ]
        if status != exp.status:
            self.store.set_status(exp.id, status)

    def _delete(self, exp: Experiment) -> None:
        self.calls.delete(exp.id)  # not waited on
        self.backend.delete_experiment(exp.id)
        self.store.delete(exp.id)
        self._final_since.pop(exp.id, None)
        self._ended_at.pop(exp.id, None)
        log.info("experiment deleted", experiment=exp.id)

    def _update_gauges(self, pods: list[PodInfo]) -> None:
        for state, n in self.store.state_counts().items():
            metrics.EXPERIMENTS.labels(state=state).set(n)
        metrics.PODS_LIVE.set(sum(1 for p in pods if p.live))
