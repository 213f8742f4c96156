"""The scaling plan (services/orchestrator/scaling.py) alone: no backend, no leaderboard."""

from __future__ import annotations

from typing import Any

from services.contracts.spec import ExperimentSpec
from services.orchestrator.backends.base import PodInfo
from services.orchestrator.scaling import env_step_allowance, plan_scale
from services.orchestrator.scheduler import Res
from services.orchestrator.status import ExperimentStatus
from tests.orchestrator.conftest import spec as spec_dict

NOW = 1_000.0
POD = Res(1, 0, 1 << 30)
ROOMY = Res(64, 0, 64 << 30)


def _spec(**over: Any) -> ExperimentSpec:
    return ExperimentSpec.model_validate(spec_dict(**over))


def _pod(pod_id: str, created_at: float, algorithm: str | None = None, **kw: Any) -> PodInfo:
    return PodInfo("e", pod_id, "Running", created_at, POD, algorithm=algorithm, **kw)


def test_at_the_target_nothing_is_planned() -> None:
    plan = plan_scale(_spec(), ExperimentStatus(), [_pod("a", 1)], 1, POD, ROOMY, NOW)
    assert plan.stop == [] and plan.create == [] and plan.reason is None and plan.end is None


def test_scale_in_stops_the_newest_pods() -> None:
    pods = [_pod("old", 1), _pod("new", 3), _pod("mid", 2)]
    plan = plan_scale(_spec(), ExperimentStatus(), pods, 1, POD, ROOMY, NOW)
    assert plan.stop == ["new", "mid"] and plan.create == []


def test_scale_in_of_an_ensemble_stops_the_algorithm_above_its_share() -> None:
    s = _spec(algorithms={"ppo": 1.0, "sac": 1.0}, env={"name": "Pendulum-v1"})
    pods = [_pod("p1", 1, "ppo"), _pod("p2", 2, "ppo"), _pod("s1", 3, "sac")]
    plan = plan_scale(s, ExperimentStatus(), pods, 2, POD, ROOMY, NOW)
    assert plan.stop == ["p2"]


def test_terminating_pods_do_not_count_toward_the_target() -> None:
    pods = [_pod("a", 1, terminating=True)]
    plan = plan_scale(_spec(), ExperimentStatus(), pods, 1, POD, ROOMY, NOW)
    assert len(plan.create) == 1


def test_an_ensemble_is_created_with_each_algorithms_share() -> None:
    s = _spec(
        algorithms={"ppo": 1.0, "sac": 1.0},
        env={"name": "Pendulum-v1"},
        population={"min_pods": 1, "max_pods": 4},
    )
    plan = plan_scale(s, ExperimentStatus(), [_pod("p1", 1, "ppo")], 4, POD, ROOMY, NOW)
    assert sorted(plan.create) == ["ppo", "sac", "sac"]


def test_capacity_limits_the_pods_created() -> None:
    plan = plan_scale(_spec(), ExperimentStatus(), [], 2, POD, Res(1.5, 0, 64 << 30), NOW)
    assert plan.create == [None]


def test_a_backoff_holds_launches_and_says_when_to_wake() -> None:
    status = ExperimentStatus(next_launch_at=NOW + 2.0)
    plan = plan_scale(_spec(), status, [], 1, POD, ROOMY, NOW)
    assert plan.create == [] and plan.wake_at == NOW + 2.0
    assert plan.reason == "backing off 2.0s after a pod failure"
    assert plan_scale(_spec(), status, [], 1, POD, ROOMY, NOW + 2.1).create == [None]


def test_the_pod_budget_caps_launches() -> None:
    s = _spec(budget={"pods_launched": 3})
    plan = plan_scale(s, ExperimentStatus(pods_launched=2), [], 2, POD, ROOMY, NOW)
    assert plan.create == [None]
    plan = plan_scale(s, ExperimentStatus(pods_launched=3), [], 2, POD, ROOMY, NOW)
    assert plan.create == [] and plan.reason == "pod budget reached (3 launched)"


def test_the_env_step_budget_is_split_over_the_pods_to_start() -> None:
    s = _spec(budget={"total_env_steps": 10_000})
    status = ExperimentStatus(env_steps=1_000, allowances={"a": 3_000})
    plan = plan_scale(s, status, [_pod("a", 1)], 2, POD, ROOMY, NOW)
    assert plan.create == [None] and plan.allowance == 6_000
    held = ExperimentStatus(env_steps=1_000, allowances={"a": 9_000})
    plan = plan_scale(s, held, [_pod("a", 1)], 2, POD, ROOMY, NOW)
    assert (
        plan.create == [] and plan.reason == "the env-step budget left is held by the running pods"
    )


# -- allowances in whole batches ------------------------------------------------------------
def test_allowances_are_whole_batches_and_a_remainder_goes_to_fewer_pods() -> None:
    s = _spec(budget={"total_env_steps": 40_960}, population={"min_pods": 1, "max_pods": 3})
    # Three pods trained 12,288 steps each in 4,096-step batches; 4,096 are left.
    status = ExperimentStatus(env_steps=36_864, batch_env_steps=4_096)
    plan = plan_scale(s, status, [], 3, POD, ROOMY, NOW)
    assert plan.create == [None] and plan.allowance == 4_096
    # The first pods: 13,653 each would leave 1,365 untrained per pod: 12,288 each instead.
    first = plan_scale(s, ExperimentStatus(batch_env_steps=4_096), [], 3, POD, ROOMY, NOW)
    assert first.create == [None, None, None] and first.allowance == 12_288
    assert env_step_allowance(s, ExperimentStatus(env_steps=36_864), [], 3) == 1_365


def test_what_is_left_below_one_batch_ends_the_experiment_once_no_pod_runs() -> None:
    s = _spec(budget={"total_env_steps": 40_960})
    status = ExperimentStatus(env_steps=36_865, batch_env_steps=4_096)
    plan = plan_scale(s, status, [], 2, POD, ROOMY, NOW)
    assert plan.create == [] and plan.end is not None
    assert plan.end[0] == "budget_exhausted" and "below one batch of 4096" in plan.end[1]
    # A pod still running (or stopping) may still report steps: no end yet, no new pod.
    running = plan_scale(s, status, [_pod("a", 1, terminating=True)], 2, POD, ROOMY, NOW)
    assert running.end is None and running.create == []


def test_fewer_batches_left_than_pods_to_start_go_to_one_pod() -> None:
    s = _spec(budget={"total_env_steps": 40_960}, population={"min_pods": 1, "max_pods": 3})
    # Three Pendulum pods (2,048-step batches) allowed 13,653 each trained 12,288: 4,096 left,
    # two batches for three pods to start. One pod trains both (one start, not two).
    status = ExperimentStatus(env_steps=36_864, batch_env_steps=2_048, batch_uniform=True)
    plan = plan_scale(s, status, [], 3, POD, ROOMY, NOW)
    assert plan.create == [None] and plan.allowance == 4_096
    # Five batches for three pods: one each now, the two left to one pod later.
    status = ExperimentStatus(env_steps=40_960 - 5 * 2_048, batch_env_steps=2_048)
    plan = plan_scale(s, status, [], 3, POD, ROOMY, NOW)
    assert plan.create == [None, None, None] and plan.allowance == 2_048


def test_running_pods_hold_the_whole_batches_of_their_allowances() -> None:
    s = _spec(budget={"total_env_steps": 40_960}, population={"min_pods": 1, "max_pods": 3})
    # One of three pods (allowed 13,653 each) ended after 12,288 steps; the two running will
    # train 12,288 each too, whatever their allowance says: 4,096 are left for one new pod.
    allowances = {"b": 13_653, "c": 13_653}
    running = [_pod("b", 1), _pod("c", 2)]
    status = ExperimentStatus(
        env_steps=12_288, batch_env_steps=2_048, batch_uniform=True, allowances=allowances
    )
    plan = plan_scale(s, status, running, 3, POD, ROOMY, NOW)
    assert plan.create == [None] and plan.allowance == 4_096
    # Pods of different batches: a running pod's allowance counts whole (it may train more of
    # it than the largest batch's whole units): nothing is left to start a pod with.
    mixed = status.model_copy(update={"batch_uniform": False})
    plan = plan_scale(s, mixed, running, 3, POD, ROOMY, NOW)
    assert (
        plan.create == [] and plan.reason == "the env-step budget left is held by the running pods"
    )


def test_running_pods_reports_are_not_held_twice_once_the_log_is_read() -> None:
    s = _spec(budget={"total_env_steps": 40_000}, population={"min_pods": 1, "max_pods": 2})
    # Two pods allowed 20,000 each; "a" was killed after 6,000, "b" runs and reported 9,000.
    running = [_pod("b", 1)]
    status = ExperimentStatus(env_steps=15_000, allowances={"b": 20_000})
    # The count alone holds b's 9,000 and its allowance holds them again.
    assert env_step_allowance(s, status, ["b"], 2) == 5_000
    # With the submission log read: what "a" left, all of it.
    logged = status.model_copy(update={"logged_env_steps": 15_000, "reported": {"b": 9_000}})
    plan = plan_scale(s, logged, running, 2, POD, ROOMY, NOW)
    assert plan.create == [None] and plan.allowance == 14_000


def test_a_stopping_pod_keeps_its_allowance_for_its_final_report() -> None:
    s = _spec(budget={"total_env_steps": 40_000}, population={"min_pods": 1, "max_pods": 2})
    # "a" (allowed 20,000, reported 5,000) was stopped to free capacity and makes its final
    # report before it exits: a new pod may not take what "a" can still report.
    stopping = [_pod("a", 1, terminating=True)]
    status = ExperimentStatus(
        env_steps=5_000, allowances={"a": 20_000}, logged_env_steps=5_000, reported={"a": 5_000}
    )
    plan = plan_scale(s, status, stopping, 2, POD, ROOMY, NOW)
    assert plan.allowance == 10_000 and len(plan.create) == 2


def test_halving_stops_the_worst_scores_first_and_waits_to_rank_pods_without_one() -> None:
    s = _spec(population={"max_pods": 4, "halving": {"rung_env_steps": 10}})
    pods = [_pod("best", 1), _pod("worst", 2), _pod("mid", 3), _pod("low", 4)]
    scores = {"best": 90.0, "worst": -5.0, "mid": 40.0, "low": 0.0}
    plan = plan_scale(s, ExperimentStatus(), pods, 2, POD, ROOMY, NOW, scores)
    assert plan.stop == ["worst", "low"] and plan.create == [] and plan.reason is None
    assert plan.stop_reasons["worst"].endswith("last score -5, not among the best 2")
    # Two pods have not reported: only what two others beat already stops now.
    new = [*pods, _pod("new", 5), _pod("newer", 6)]
    plan = plan_scale(s, ExperimentStatus(), new, 2, POD, ROOMY, NOW, scores)
    assert plan.stop == ["worst", "low"]
    assert plan.reason == "successive halving: waiting for 2 pods' first report to rank them"
    plan = plan_scale(s, ExperimentStatus(), new, 3, POD, ROOMY, NOW, {"best": 1.0, "mid": 2.0})
    assert plan.stop == [] and plan.reason is not None
    # Lower is better: the highest scores stop.
    s.evaluation.higher_is_better = False
    plan = plan_scale(s, ExperimentStatus(), pods[:3], 1, POD, ROOMY, NOW, scores)
    assert plan.stop == ["best", "mid"]
