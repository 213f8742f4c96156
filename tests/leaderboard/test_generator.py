"""Generator strategies, statistically: PBT exploits only the top quantile and explores within
bounds; CEM's samples move toward the top; entry-point registration."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest
from pydantic import TypeAdapter, ValidationError

from services import registry
from services.contracts.algorithms.card import card
from services.contracts.search_space import SearchSpace
from services.leaderboard.generator import (
    CandidateView,
    CEMGenerator,
    Context,
    PBTGenerator,
    RandomGenerator,
    fit_gaussian,
    load_strategy,
)

SPACE = TypeAdapter(SearchSpace).validate_python(
    {
        "lr": {"type": "log_uniform", "low": 1e-5, "high": 1e-2},
        "gamma": {"type": "uniform", "low": 0.9, "high": 0.999},
        "batch_size": {"type": "choice", "values": [32, 64, 128, 256]},
        "epochs": {"type": "int_uniform", "low": 1, "high": 10},
    }
)


def board(n: int, rng: random.Random, algorithm: str = "ppo") -> list[CandidateView]:
    cands = [
        CandidateView(
            candidate_id=f"{algorithm}-{i}",
            algorithm=algorithm,
            hyperparameters={name: d.sample(rng) for name, d in SPACE.items()},
            generation=i % 3,
            score=float(n - i),
        )
        for i in range(n)
    ]
    return cands  # best first


def ctx(cands: list[CandidateView], rng: random.Random) -> Context:
    return Context("e", "ppo", SPACE, cands, top_k=len(cands), rng=rng)


def test_builtins_registered_as_entry_points() -> None:
    assert {"random", "pbt", "cem"} <= set(registry.names(registry.GENERATORS))
    assert isinstance(load_strategy("pbt", {"quantile": 0.5}), PBTGenerator)
    assert isinstance(load_strategy("cem", {}), CEMGenerator)
    assert isinstance(load_strategy("random", {}), RandomGenerator)
    with pytest.raises(registry.UnknownNameError):
        load_strategy("simulated-annealing", {})
    with pytest.raises(ValidationError):
        load_strategy("pbt", {"quantile": 0})


def test_pbt_exploits_only_the_top_quantile_roughly_uniformly() -> None:
    rng = random.Random(1)
    cands = board(20, rng)
    pbt = PBTGenerator({})  # quantile 0.25 -> the best 5 of 20
    parents = Counter(pbt.propose(ctx(cands, rng)).parent.candidate_id for _ in range(4000))
    top = {c.candidate_id for c in cands[:5]}
    assert set(parents) == top
    for count in parents.values():
        assert abs(count / 4000 - 0.2) < 0.03
    # A different quantile moves the cut.
    pbt50 = PBTGenerator({"quantile": 0.5})
    parents = {pbt50.propose(ctx(cands, rng)).parent.candidate_id for _ in range(2000)}
    assert parents == {c.candidate_id for c in cands[:10]}
    # Never fewer than one parent.
    assert PBTGenerator({"quantile": 0.01}).parents(cands[:3]) == cands[:1]


def test_pbt_truncation_replaces_only_the_bottom_share() -> None:
    rng = random.Random(3)
    hyper = {name: d.sample(rng) for name, d in SPACE.items()}
    # Four pods, two entries each, best first: pod p0 at best 40, p1 30, p2 20, p3 10.
    scores = [("p0", 40), ("p1", 30), ("p0", 25), ("p2", 20), ("p1", 15), ("p3", 10), ("p2", 5)]
    cands = [
        CandidateView(f"c{i}", "ppo", hyper, 0, float(s), pod_id=pod)
        for i, (pod, s) in enumerate(scores)
    ]

    def ask(pbt: PBTGenerator, pod: str, score: float | None, **kw) -> str:
        c = Context("e", "ppo", SPACE, cands, 8, rng, pod_id=pod, score=score, **kw)
        return pbt.propose(c).decision

    quarter = PBTGenerator({"truncation": 0.25})  # 1 of 4 pods replaced
    assert ask(quarter, "p3", 10.0) == "explore"  # the worst pod gets a parent
    assert ask(quarter, "p2", 20.0) == "keep"  # the others keep training
    assert ask(quarter, "p3", 25.0) == "keep"  # its current score counts: p2 is now the worst
    assert ask(quarter, "p0", 5.0) == "explore"  # and not its best entry
    # A pod not on the board yet makes 5 pods, of which ceil(1.25) = 2 are replaced.
    assert ask(quarter, "p9", 12.0) == "explore" and ask(quarter, "p9", 25.0) == "keep"
    half = PBTGenerator({"truncation": 0.5})
    assert ask(half, "p2", 20.0) == "explore" and ask(half, "p1", 30.0) == "keep"
    assert ask(quarter, "p0", None) == "explore"  # a starting pod is never told to keep
    assert ask(PBTGenerator({"truncation": None}), "p0", 39.0) == "explore"  # the tournament rule
    # Lower is better: the board is then best (lowest) first, and 40 is the worst pod.
    cands.reverse()
    assert ask(quarter, "p0", 40.0, higher_is_better=False) == "explore"
    assert ask(quarter, "p3", 10.0, higher_is_better=False) == "keep"
    with pytest.raises(ValidationError):
        PBTGenerator({"truncation": 0})


def test_pbt_truncation_defaults_to_the_algorithm_cards() -> None:
    """Unset, ``truncation`` is the asking pod's algorithm card's ``pbt_truncation``: PPO
    replaces only its bottom quarter (replacing every pod below the leader copied one policy
    over the pods still exploring: docs/benchmarks.md), SAC any pod below the best (the
    tournament rule, where PBT measured fastest); set, the spec's value holds for both."""
    rng = random.Random(3)
    hyper = {name: d.sample(rng) for name, d in SPACE.items()}
    pods = [("p0", 40.0), ("p1", 30.0), ("p2", 20.0), ("p3", 10.0)]

    def ask(options: dict, algorithm: str, pod: str, score: float) -> str:
        cands = [CandidateView(f"c{p}", algorithm, hyper, 0, s, pod_id=p) for p, s in pods]
        ctx = Context("e", algorithm, SPACE, cands, 8, rng, pod_id=pod, score=score)
        return PBTGenerator(options).propose(ctx).decision

    assert card("ppo").pbt_truncation == 0.25 and card("sac").pbt_truncation is None
    assert ask({}, "ppo", "p2", 20.0) == "keep" and ask({}, "ppo", "p3", 10.0) == "explore"
    assert ask({}, "sac", "p2", 20.0) == "explore"
    assert ask({"truncation": None}, "ppo", "p2", 20.0) == "explore"
    assert ask({"truncation": 0.25}, "sac", "p2", 20.0) == "keep"
    assert ask({}, "an-algorithm-without-a-card", "p2", 20.0) == "explore"


def test_pbt_explore_perturbs_within_bounds() -> None:
    rng = random.Random(2)
    width = SPACE["gamma"].high - SPACE["gamma"].low
    cands = board(12, rng)
    # Parents at the bounds, so clamping is exercised.
    cands[0] = CandidateView(
        "edge", "ppo", {"lr": 1e-2, "gamma": 0.9, "batch_size": 256, "epochs": 1}, 0, 100.0
    )
    pbt = PBTGenerator({})
    resampled = moved = 0
    for _ in range(3000):
        p = pbt.propose(ctx(cands, rng))
        assert p.decision == "explore"
        parent = p.parent.hyperparameters
        h = p.hyperparameters
        assert 1e-5 <= h["lr"] <= 1e-2 and 0.9 <= h["gamma"] <= 0.999
        assert h["batch_size"] in (32, 64, 128, 256) and 1 <= h["epochs"] <= 10
        assert isinstance(h["epochs"], int)
        how = p.details["explore"]
        for name, step in (
            ("lr", lambda v, f: v * f),  # log range: multiplied
            ("gamma", lambda v, f: v + (f - 1) * width),  # linear range: 20% of its width
        ):
            expected = {SPACE[name].clamp(step(parent[name], f)) for f in (0.8, 1.2)}
            if f'"{name}": "perturbed"' in how:
                moved += 1
                assert any(math.isclose(h[name], e, rel_tol=1e-12) for e in expected)
            else:
                resampled += 1
        if '"batch_size": "perturbed"' in how:
            values = [32, 64, 128, 256]
            assert abs(values.index(h["batch_size"]) - values.index(parent["batch_size"])) == 1
    assert abs(resampled / (resampled + moved) - 0.25) < 0.03
    # A discount in the middle of its range moves by a fifth of the range, not onto a bound.
    assert math.isclose(SPACE["gamma"].perturb(0.95, rng, (0.8,)), 0.95 - 0.2 * width)


def test_pbt_fresh_on_empty_board_and_pure_exploit() -> None:
    rng = random.Random(3)
    p = PBTGenerator({}).propose(ctx([], rng))
    assert p.decision == "fresh" and p.parent is None
    cands = board(4, rng)
    p = PBTGenerator({"explore": False}).propose(ctx(cands, rng))
    assert p.decision == "exploit" and p.hyperparameters == cands[0].hyperparameters


def test_cem_mean_moves_toward_the_top() -> None:
    """Score peaks at gamma=0.98, lr=1e-4; CEM's samples concentrate there, generation after
    generation, starting from the uniform prior."""
    rng = random.Random(4)
    cem = CEMGenerator({"min_std_fraction": 0.01})

    def score(h: dict) -> float:
        return -(((h["gamma"] - 0.98) / 0.1) ** 2) - (math.log10(h["lr"]) + 4) ** 2

    population = [{n: d.sample(rng) for n, d in SPACE.items()} for _ in range(40)]
    prior_gamma = np.mean([h["gamma"] for h in population])
    prior_lr = np.mean([math.log10(h["lr"]) for h in population])
    for _ in range(6):
        ranked = sorted(population, key=score, reverse=True)[:10]  # the top K
        elite = [CandidateView(f"c{i}", "ppo", h, 0, score(h)) for i, h in enumerate(ranked)]
        population = ranked + [cem.propose(ctx(elite, rng)).hyperparameters for _ in range(30)]
    samples = [cem.propose(ctx(elite, rng)).hyperparameters for _ in range(500)]
    gamma = np.mean([h["gamma"] for h in samples])
    lr = np.mean([math.log10(h["lr"]) for h in samples])
    assert abs(gamma - 0.98) < abs(prior_gamma - 0.98) / 3
    assert abs(lr + 4) < abs(prior_lr + 4) / 3
    for h in samples:  # always inside the space
        assert 1e-5 <= h["lr"] <= 1e-2 and 0.9 <= h["gamma"] <= 0.999


def test_cem_fits_the_elites_gaussian() -> None:
    rng = np.random.default_rng(5)
    true_mean = np.array([math.log(1e-3), 0.95])
    true_cov = np.array([[0.04, 0.002], [0.002, 0.0004]])
    draws = rng.multivariate_normal(true_mean, true_cov, size=4000)
    elite = [{"lr": math.exp(a), "gamma": b} for a, b in draws]
    space = {k: SPACE[k] for k in ("lr", "gamma")}
    fit = fit_gaussian(space, elite)
    assert fit.names == ["lr", "gamma"]
    np.testing.assert_allclose(fit.mean, true_mean, atol=0.01)
    np.testing.assert_allclose(fit.covariance, true_cov, atol=0.003)
    # Samples reproduce the correlation (covariance, not just variances).
    cem = CEMGenerator({"min_std_fraction": 0.0})
    r = random.Random(6)
    views = [CandidateView(f"c{i}", "ppo", h, 0, 0.0) for i, h in enumerate(elite[:400])]
    c = Context("e", "ppo", space, views, 400, r)
    out = np.array(
        [
            [math.log(h["lr"]), h["gamma"]]
            for h in (cem.propose(c).hyperparameters for _ in range(2000))
        ]
    )
    assert np.corrcoef(out, rowvar=False)[0, 1] > 0.3


def test_cem_ignores_unusable_elite_rows() -> None:
    """A candidate whose hyperparameters are missing or not numbers neither breaks the fit nor
    steers it; with too few usable rows CEM samples the space instead of collapsing."""
    rng = random.Random(8)
    space = {k: SPACE[k] for k in ("lr", "gamma")}
    good = [{"lr": 1e-4 * (1 + 0.01 * i), "gamma": 0.98} for i in range(6)]
    odd = [{"lr": "fast", "gamma": 0.95}, {"gamma": 0.91}, {"lr": float("nan"), "gamma": 0.9}]
    views = [CandidateView(f"c{i}", "ppo", h, 0, 0.0) for i, h in enumerate(odd + good)]
    cem = CEMGenerator({"min_std_fraction": 0.01})
    lrs = [
        cem.propose(Context("e", "ppo", space, views, 9, rng)).hyperparameters["lr"]
        for _ in range(200)
    ]
    assert abs(np.median(np.log10(lrs)) + 4) < 0.3  # fitted to the six usable rows
    only_odd = [CandidateView(f"o{i}", "ppo", h, 0, 0.0) for i, h in enumerate(odd)]
    lrs = [
        cem.propose(Context("e", "ppo", space, only_odd, 3, rng)).hyperparameters["lr"]
        for _ in range(200)
    ]
    assert len(set(lrs)) > 100 and min(lrs) < 1e-3 < max(lrs)  # the prior, not one bound


def test_cem_categorical_follows_the_elite() -> None:
    rng = random.Random(7)
    elite = [
        CandidateView(
            f"c{i}", "ppo", {**board(1, rng)[0].hyperparameters, "batch_size": 128}, 0, 1.0
        )
        for i in range(20)
    ]
    picks = Counter(
        CEMGenerator({}).propose(ctx(elite, rng)).hyperparameters["batch_size"] for _ in range(1000)
    )
    assert picks.most_common(1)[0][0] == 128 and picks[128] > 700


def test_random_samples_the_space() -> None:
    rng = random.Random(8)
    lrs = [RandomGenerator({}).propose(ctx([], rng)).hyperparameters["lr"] for _ in range(4000)]
    logs = np.log10(lrs)
    assert logs.min() >= -5 and logs.max() <= -2
    # Log-uniform: each decade gets about a third.
    for lo in (-5, -4, -3):
        share = np.mean((logs >= lo) & (logs < lo + 1))
        assert abs(share - 1 / 3) < 0.04


PLUGIN = """
from services.leaderboard.generator import Proposal, Strategy


class AlwaysBest(Strategy):
    name = "always-best"

    def propose(self, ctx):
        if not ctx.candidates:
            return Proposal("fresh", {"lr": 1e-3})
        return Proposal("exploit", dict(ctx.candidates[0].hyperparameters), ctx.candidates[0])
"""


def test_third_party_strategy_plugs_in_through_entry_points(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A distribution that registers a strategy under `podium.generators` is usable by name,
    with no change to Podium (installed here as a real .dist-info on sys.path)."""
    import importlib

    from fastapi.testclient import TestClient

    from services.leaderboard.app import create_app
    from tests.leaderboard.conftest import AUTH, experiment, result, settings_for

    (tmp_path / "podium_plugin_gen.py").write_text(PLUGIN)
    dist = tmp_path / "podium_plugin_gen-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: podium-plugin-gen\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[podium.generators]\nalways-best = podium_plugin_gen:AlwaysBest\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert "always-best" in registry.names(registry.GENERATORS)

    api = "/api/v1/experiments/p"
    with TestClient(create_app(settings_for(tmp_path / "d")), headers=AUTH) as client:
        assert client.put(api, json=experiment(strategy="always-best")).status_code == 201
        for i, s in enumerate([1.0, 3.0, 2.0]):
            client.post(f"{api}/submissions", json=result(f"s{i}", s))
        m = client.post(f"{api}/generate", json={"pod_id": "x"}).json()
        assert m["strategy"] == "always-best" and m["decision"] == "exploit"
        best = client.get(f"{api}/best").json()
        assert m["parent_id"] == best["candidate_id"]


BROKEN = """
from services.leaderboard.generator import Strategy


class Raises(Strategy):
    name = "raises"

    def propose(self, ctx):
        raise RuntimeError("boom")


class NotAStrategy:
    pass
"""


def test_a_broken_strategy_plugin_is_named_and_never_a_500(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A strategy that raises in ``propose`` answered 500: every pod retried it as "leaderboard
    unavailable" until the wall-time budget ended. Now a 409 naming it, which a pod takes as
    bad input (the experiment fails at once). One that is no Strategy, or whose module does
    not import, was a 500 at the PUT and at submission; now a 422 naming the entry point."""
    from fastapi.testclient import TestClient

    from services.contracts.spec import ExperimentSpec
    from services.leaderboard.app import create_app
    from tests.leaderboard.conftest import AUTH, experiment, settings_for
    from tests.pod.plugins import register_plugin

    (tmp_path / "src").mkdir()
    register_plugin(
        tmp_path / "src",
        monkeypatch,
        "podium_broken_gen",
        BROKEN,
        {"podium.generators": {"raises": "podium_broken_gen:Raises",
                               "not-a-strategy": "podium_broken_gen:NotAStrategy",
                               "missing": "podium_no_such_module:Thing"}},
    )  # fmt: skip
    api = "/api/v1/experiments/p"
    with TestClient(create_app(settings_for(tmp_path / "d")), headers=AUTH) as client:
        assert client.put(api, json=experiment(strategy="raises")).status_code == 201
        answer = client.post(f"{api}/generate", json={"pod_id": "x"})
        assert answer.status_code == 409, answer.text
        assert "'raises' failed to propose: RuntimeError('boom')" in answer.json()["detail"]
        for name, says in [("not-a-strategy", "is not a Strategy subclass"),
                           ("missing", "podium_no_such_module:Thing in podium.generators) "
                                       "cannot be loaded: ModuleNotFoundError")]:  # fmt: skip
            answer = client.put(f"{api}-{name}", json=experiment(strategy=name))
            assert answer.status_code == 422 and says in answer.text, answer.text
    for name, says in [("not-a-strategy", "declares no Options model"),
                       ("missing", "cannot be loaded: ModuleNotFoundError")]:  # fmt: skip
        spec = {"name": "x", "env": {"name": "CartPole-v1"}, "algorithms": {"ppo": 1},
                "generator": {"strategy": name}}  # fmt: skip
        with pytest.raises(ValidationError, match=says):
            ExperimentSpec.model_validate(spec)
