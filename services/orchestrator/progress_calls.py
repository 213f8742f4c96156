"""The reconciler's calls to the leaderboard: concurrent, bounded, behind a circuit breaker,
and never waited on by a reconcile pass.

A pass asks for what it needs (an experiment's progress, a registration, a deletion) and gets
at once what is known; the call itself runs on a small thread pool (one call per experiment
and kind in flight at most), and its answer wakes the reconciler. So a leaderboard that hangs
or is down costs a pass nothing: pods are still replaced and scaled, and only what needs the
leaderboard's answer (the target return, the env-step budget, the first pods of a new
experiment) waits for it. After ``failure_threshold`` failures in a row the breaker
(``circuitbreaker``, which unlike pybreaker does not serialise calls under a lock) opens and
calls fail at once until ``recovery_timeout`` has passed; 4xx answers are answers, not
failures.

A failed call is not asked again at once: each experiment's calls back off (``retry_delay``:
doubling from the poll interval up to the breaker's recovery timeout, jittered, and never
before an open breaker lets calls through), and a failure wakes the reconciler only when a
pass waits on it. Otherwise a failure, answered at once by an open breaker, would wake a pass
that asks again at once: the loop would spin (thousands of passes a second) for as long as
the leaderboard is down, and on after it is back.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import circuitbreaker

from services.api_client import ServiceError
from services.contracts.spec import ExperimentSpec
from services.logs import get_logger
from services.orchestrator.leaderboard_client import Progress, ProgressSource, Reports, pod_of

log = get_logger(__name__)


def _is_answer(exc: BaseException) -> bool:
    """A 4xx is the leaderboard answering (it refused something), not it being unavailable."""
    return isinstance(exc, ServiceError) and exc.status is not None and exc.status < 500


@dataclass
class _Board:
    """What is known of one experiment on the leaderboard."""

    progress: Progress | None = None
    asked_at: float = 0.0  # when the request behind ``progress`` was sent (monotonic)
    failed_at: float = 0.0  # when the last request that failed was sent
    #: Pods with a decided report → the gcd of their reports' env steps (whole batches).
    reporters: dict[str, int] = field(default_factory=dict)
    #: Pods with a decided report → the score of their last.
    scores: dict[str, float] = field(default_factory=dict)
    cursor: str | None = None  # submission-log cursor of ``reporters``
    #: Pod → env steps of its reports read so far (``Progress.reported``), and the reports
    #: the last read returned: the next one returns those after its cursor again.
    steps: dict[str, int] = field(default_factory=dict)
    last_read: frozenset[str] = frozenset()
    inflight: bool = False  # a progress request is sent and not answered yet
    awaited: bool = False  # a pass waits for an answer newer than some time: wake it
    failures: int = 0  # progress requests failed in a row
    retry_at: float = 0.0  # no progress request before this (monotonic): backing off
    registered: Future[Any] | None = None
    register_failures: int = 0  # registrations failed in a row
    register_error: BaseException | None = None  # the last registration's failure
    register_retry_at: float = 0.0  # no registration request before this (monotonic)


class ProgressCalls:
    def __init__(
        self,
        source: ProgressSource,
        workers: int,
        breaker: circuitbreaker.CircuitBreaker,
        wake: Callable[[], None],
        min_retry_s: float = 0.1,
        max_retry_s: float = 10.0,
    ):
        self.source = source
        self.breaker = breaker
        self.wake = wake
        # A failed call is made again after min_retry_s, doubling up to max_retry_s (the
        # breaker's recovery timeout), jittered so experiments do not retry in lockstep.
        self.min_retry_s, self.max_retry_s = min_retry_s, max_retry_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="leaderboard")
        self._lock = threading.Lock()
        self._boards: dict[str, _Board] = {}

    def _board(self, exp_id: str) -> _Board:
        with self._lock:
            return self._boards.setdefault(exp_id, _Board())

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.breaker.decorate(fn)(*args)  # raises CircuitBreakerError while open

    def retry_delay(self, failures: int) -> float:
        """Seconds before a call that failed ``failures`` times in a row is made again."""
        base = min(self.max_retry_s, self.min_retry_s * 2 ** min(failures - 1, 30))
        delay = base * random.uniform(0.5, 1.0)
        # While the breaker is open a call fails at once without reaching the leaderboard.
        return max(delay, self.breaker.open_remaining if self.breaker.opened else 0.0)

    # -- progress ----------------------------------------------------------------------------
    def _fetch(self, exp_id: str, board: _Board, asked_at: float, read_log: bool) -> None:
        try:
            reports = Reports({}, {}, board.cursor)
            if read_log:  # before the count: it holds at least the reports read
                reports = self._call(self.source.reporters, exp_id, board.cursor)
            prog = self._call(self.source.progress, exp_id)
        except Exception as e:
            board.failed_at = asked_at
            board.failures += 1
            board.retry_at = time.monotonic() + self.retry_delay(board.failures)
            if not isinstance(e, circuitbreaker.CircuitBreakerError):
                log.warning("leaderboard progress unavailable", experiment=exp_id, error=str(e))
            changed = False  # nothing new is known: only a pass waiting for it is woken
        else:
            if read_log:
                summed = dict(board.steps)
                for sid, (reporter, n) in reports.reports.items():
                    if sid not in board.last_read:
                        pod = pod_of(reporter)
                        summed[pod] = summed.get(pod, 0) + n
                board.steps, board.last_read = summed, frozenset(reports.reports)
            prog = replace(prog, reported=board.steps)
            merged = {
                pod: math.gcd(board.reporters.get(pod, 0), steps)
                for pod, steps in reports.batches.items()
            }
            changed = (
                prog != board.progress
                or any(board.reporters.get(pod) != steps for pod, steps in merged.items())
                or any(board.scores.get(pod) != score for pod, score in reports.scores.items())
            )
            # Rebound, not updated: read by other threads. The batches and scores before the
            # count that holds their reports: a pass that reads this count (its ``progress``)
            # then reads their batch (``batch``), and counts new pods' allowances in it.
            board.reporters = {**board.reporters, **merged}
            board.scores = {**board.scores, **reports.scores}
            board.cursor = reports.cursor
            board.progress, board.asked_at = prog, asked_at
            board.failures, board.retry_at = 0, 0.0
        finally:
            board.inflight = False
        if not changed and not board.awaited:
            return
        board.awaited = False
        self.wake()

    def progress(
        self,
        exp_id: str,
        max_age_s: float,
        since: float | None = None,
        pods: Iterable[str] = (),
        read_log: bool = False,
    ) -> tuple[Progress, bool]:
        """The last known progress (empty when none yet), and whether it is settled: an answer
        (or a failure) to a request sent at or after ``since`` (monotonic) is in.

        Sends a request when the last answer is older than ``max_age_s`` or than ``since``,
        unless backing off after a failure; it also reads the submission log (which pods
        have reported, ``batch``, ``pod_scores``) while one of ``pods`` (the live ones) is not
        known to have, or always with ``read_log`` (an experiment with an env-step budget,
        or successive halving).
        """
        board = self._board(exp_id)
        now = time.monotonic()
        last = max(board.asked_at, board.failed_at)
        settled = since is None or last >= since
        stale = now - board.asked_at >= max_age_s or not settled
        board.awaited = board.awaited or not settled
        if stale and not board.inflight and now >= board.retry_at:
            # Marked before it is sent: the answer may come before submit returns.
            board.inflight = True
            read_log = read_log or any(not self.reported(exp_id, p) for p in pods)
            self._pool.submit(self._fetch, exp_id, board, now, read_log)
        return board.progress or Progress(), settled

    def batch(self, exp_id: str) -> int | None:
        """Env steps one agent trains per step, as far as the reports show: the largest over
        the pods of the gcd of each one's reports and the batches they said (its batch once a
        report said it; at least its batch: every report is a whole number of batches). None
        before any report with steps or a batch."""
        return max(self._board(exp_id).reporters.values(), default=0) or None

    def batch_is_uniform(self, exp_id: str) -> bool:
        """Whether every pod that reported steps trains the same batch (``batch``)."""
        return len({steps for steps in self._board(exp_id).reporters.values() if steps}) == 1

    def pod_scores(
        self, exp_id: str, pods: Iterable[str], higher_is_better: bool = True
    ) -> dict[str, float]:
        """The last score each of ``pods`` reported, as far as known now (a population pod's:
        its best agent's, each agent reporting as ``<pod>.m<i>``); a pod with no report yet
        is left out."""
        best = max if higher_is_better else min
        by_pod: dict[str, list[float]] = {}
        wanted = set(pods)
        for reporter, score in self._board(exp_id).scores.items():
            if (pod := pod_of(reporter)) in wanted:
                by_pod.setdefault(pod, []).append(score)
        return {pod: best(scores) for pod, scores in by_pod.items()}

    def reported(self, exp_id: str, pod_id: str) -> bool:
        """Whether the pod had a report decided by the leaderboard (as far as known now); a
        population pod reports as ``<pod>.m<i>``."""
        return any(pod_of(reporter) == pod_id for reporter in self._board(exp_id).reporters)

    # -- register / delete -------------------------------------------------------------------
    def register(self, exp_id: str, spec: ExperimentSpec) -> bool:
        """True once registered; False while the first call is in flight (sent now if not
        yet). Raises what the call raised (then the next call tries again), and while a retry
        is in flight the failure before it: a user reads that the leaderboard is unavailable
        until it answers, not that the experiment is being registered."""
        board = self._board(exp_id)
        fut = board.registered
        if fut is None:
            if board.register_error is not None and time.monotonic() < board.register_retry_at:
                raise board.register_error  # backing off: the last failure stands
            board.registered = fut = self._pool.submit(self._register, exp_id, spec)
        if not fut.done():
            if board.register_error is not None:
                raise board.register_error  # retrying: the last failure stands
            return False
        board.registered = None
        error = fut.exception()
        if error is not None:
            board.register_failures += 1
            board.register_error = error
            board.register_retry_at = time.monotonic() + self.retry_delay(board.register_failures)
            raise error
        board.register_failures, board.register_error = 0, None
        return True

    def _register(self, exp_id: str, spec: ExperimentSpec) -> None:
        try:
            self._call(self.source.register, exp_id, spec)
        finally:
            self.wake()

    def delete(self, exp_id: str) -> None:
        """Fire and forget: the experiment is forgotten here at once."""
        with self._lock:
            self._boards.pop(exp_id, None)
        self._pool.submit(self._delete, exp_id)

    def _delete(self, exp_id: str) -> None:
        try:
            self._call(self.source.delete, exp_id)
        except Exception as e:
            log.warning("leaderboard delete failed", experiment=exp_id, error=str(e))

    def forget(self, exp_id: str) -> None:
        with self._lock:
            self._boards.pop(exp_id, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def make_breaker(failures: int, recovery_s: float) -> circuitbreaker.CircuitBreaker:
    return circuitbreaker.CircuitBreaker(
        failure_threshold=failures,
        recovery_timeout=recovery_s,
        expected_exception=lambda _type, exc: not _is_answer(exc),
        name="leaderboard",
    )
