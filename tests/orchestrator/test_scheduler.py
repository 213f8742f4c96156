"""The pure scheduling decisions: capacity, min-or-nothing, strict priority, fair share."""

from __future__ import annotations

from services.orchestrator.scheduler import (
    Demand,
    Res,
    allocate,
    assign_algorithms,
    backoff_delay,
    launchable,
    scale_in,
)

GI = 2**30


def d(exp: str, prio: int = 0, t: float = 0.0, lo: int = 1, hi: int = 4, **res) -> Demand:
    per_pod = Res(res.get("cpu", 1.0), res.get("gpus", 0), res.get("memory", GI))
    return Demand(exp, prio, t, lo, hi, per_pod)


def test_single_experiment_gets_max_when_it_fits_and_what_fits_otherwise() -> None:
    assert allocate([d("a", hi=3)], Res(8, 0, 64 * GI)).pods == {"a": 3}
    assert allocate([d("a", hi=10)], Res(5.5, 0, 64 * GI)).pods == {"a": 5}
    assert allocate([d("a", hi=10, gpus=1)], Res(64, 2, 64 * GI)).pods == {"a": 2}
    assert allocate([d("a", hi=10, memory=8 * GI)], Res(64, 0, 20 * GI)).pods == {"a": 2}


def test_below_min_pods_means_nothing_and_a_reason() -> None:
    out = allocate([d("a", lo=3, hi=4)], Res(2, 0, 64 * GI))
    assert out.pods == {"a": 0}
    assert "min_pods=3" in out.pending_reason["a"]
    out = allocate([d("a", gpus=4)], Res(16, 2, 64 * GI))
    assert out.pods == {"a": 0} and "one pod needs 1 CPU, 4 GPU" in out.pending_reason["a"]


def test_strict_priority_preempts_lower() -> None:
    cap = Res(4, 0, 64 * GI)
    out = allocate([d("low", 0, t=0, hi=4), d("high", 10, t=1, lo=3, hi=3)], cap)
    assert out.pods == {"high": 3, "low": 1}
    out = allocate([d("low", 0, t=0, lo=2, hi=4), d("high", 10, t=1, lo=3, hi=3)], cap)
    assert out.pods == {"high": 3, "low": 0} and "low" in out.pending_reason


def test_fair_share_within_a_priority_level() -> None:
    cap = Res(8, 0, 64 * GI)
    out = allocate([d("a", t=0, hi=8), d("b", t=1, hi=8)], cap)
    assert out.pods == {"a": 4, "b": 4}
    out = allocate([d("a", t=0, hi=8), d("b", t=1, hi=8), d("c", t=2, hi=1)], cap)
    assert out.pods == {"a": 4, "b": 3, "c": 1}
    # Dominant-resource fairness: a 4-CPU pod weighs as much as four 1-CPU pods.
    out = allocate([d("big", t=0, hi=8, cpu=4), d("small", t=1, hi=8, cpu=1)], Res(16, 0, 64 * GI))
    assert out.pods == {"big": 2, "small": 8}


def test_allocation_is_deterministic_and_never_exceeds_capacity() -> None:
    import random

    rng = random.Random(0)
    for _ in range(200):
        demands = [
            d(
                f"e{i}",
                prio=rng.choice([0, 0, 5]),
                t=float(i),
                lo=(lo := rng.randint(1, 3)),
                hi=lo + rng.randint(0, 5),
                cpu=rng.choice([0.5, 1, 2]),
                gpus=rng.choice([0, 0, 1]),
                memory=rng.choice([1, 4]) * GI,
            )
            for i in range(rng.randint(1, 6))
        ]
        cap = Res(rng.randint(0, 16), rng.randint(0, 4), rng.randint(0, 32) * GI)
        out = allocate(demands, cap)
        assert out == allocate(list(reversed(demands)), cap)
        used = Res()
        for dem in demands:
            n = out.pods[dem.experiment_id]
            assert n == 0 or dem.min_pods <= n <= dem.max_pods
            assert (n == 0) == (dem.experiment_id in out.pending_reason)
            used = used + dem.per_pod.times(n)
        assert used.fits_in(cap)


def test_launchable_only_into_free_resources() -> None:
    per = Res(1, 0, GI)
    assert launchable(4, 1, per, Res(8, 0, 64 * GI)) == 3
    assert launchable(4, 1, per, Res(1.5, 0, 64 * GI)) == 1  # the rest wait for exits
    assert launchable(2, 3, per, Res(8, 0, 64 * GI)) == 0


def test_backoff_doubles_up_to_the_cap() -> None:
    assert [backoff_delay(n, 0.5, 3.0) for n in range(7)] == [0, 0, 0.5, 1, 2, 3, 3]


def test_an_ensembles_pods_follow_the_weights() -> None:
    assert assign_algorithms({"ppo": 1.0, "sac": 1.0}, [], 2) == ["ppo", "sac"]
    assert sorted(assign_algorithms({"a": 3.0, "b": 1.0}, [], 8)) == ["a"] * 6 + ["b"] * 2
    # Running pods count: the new pods make up what the running ones lack.
    assert assign_algorithms({"ppo": 1.0, "sac": 1.0}, ["sac", "sac"], 2) == ["ppo", "ppo"]
    # The furthest below its share first: a fresh experiment's first pod is its heaviest.
    assert assign_algorithms({"a": 1.0, "b": 2.0}, [], 1) == ["b"]
    # A weight of 0 gets no pod; a running pod of another algorithm takes no one's share.
    assert assign_algorithms({"a": 1.0, "b": 0.0, "d": 1.0}, ["c", None], 2) == ["a", "d"]
    # One algorithm: no pod is given one (the generator's only choice).
    assert assign_algorithms({"a": 1.0, "b": 0.0}, ["c"], 2) == [None, None]


def test_an_ensemble_scales_in_by_its_surplus() -> None:
    # The newest pod of the algorithm furthest above its share of the pods that stay.
    assert scale_in({"ppo": 1.0, "sac": 1.0}, ["ppo", "sac", "ppo"], 1) == [2]
    assert scale_in({"ppo": 1.0, "sac": 1.0}, ["ppo", "ppo", "sac"], 1) == [1]  # not the newest
    assert scale_in({"ppo": 1.0, "sac": 1.0}, ["ppo", "ppo", "sac"], 2) == [1, 2]
    # A pod whose algorithm is not known goes first; one algorithm: the newest pods.
    assert scale_in({"a": 1.0, "b": 1.0}, ["a", None, "b", "a"], 1) == [1]
    assert scale_in({"ppo": 1.0}, ["ppo", "ppo", "ppo"], 2) == [2, 1]
