"""Off-policy populations (services/pod/training/offpolicy_population.py): P SAC (TD3, DDPG, DQN)
agents stacked in one process update exactly as P single agents do, train from their roles
(worker, learner) exactly as the trainer's inline loop did, keep each slot's counters on the
device, refuse what they cannot train, and learn Pendulum (DQN: CartPole). The save/load
contract (a slot's files are a single agent pod's) is in tests/pod/test_trainers.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch.utils._python_dispatch import TorchDispatchMode

from services.contracts.algorithms.hyperparameters import HyperparameterError
from services.contracts.spec import ExperimentSpec
from services.pod.algorithms.kstep import KStep
from services.pod.algorithms.replay_buffer import Batch
from services.pod.algorithms.sac import SAC, SACConfig
from services.pod.envs.registry import make_env
from services.pod.training import offpolicy_population
from services.pod.training.checkpoint import read_files
from services.pod.training.fit import build as build_single
from services.pod.training.offpolicy_population import (
    OffPolicyPopulationTrainer,
    PopulationDQN,
    PopulationSAC,
)
from services.pod.training.presets import pod_config, preset
from services.pod.training.trainer import Counters, trainer_class
from tests.pod.harness import Leaderboard, download, register, runtime, submit_outside_parent

HPS = [
    {"learning_rate": 1e-3, "gamma": 0.99, "tau": 0.005, "init_alpha": 1.0},
    {"learning_rate": 3e-3, "gamma": 0.95, "tau": 0.02, "init_alpha": 0.5},
    {"learning_rate": 5e-4, "gamma": 0.9, "tau": 0.1, "init_alpha": 0.2, "target_entropy": -2.0},
]


def spaces() -> tuple[Any, Any]:
    env = make_env("Pendulum-v1", 1)
    env.close()
    return env.single_observation_space, env.single_action_space


def agents(autotune: bool = True) -> list[SAC]:
    env = make_env("Pendulum-v1", 1)
    out = []
    for i, hp in enumerate(HPS):
        torch.manual_seed(i)
        config = SACConfig(hidden_sizes=[32, 32], autotune_alpha=autotune, **hp)
        out.append(SAC(env.single_observation_space, env.single_action_space, config))
    env.close()
    return out


def batches(p: int, b: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(
        obs=torch.randn(p, b, 3, generator=g),
        action=torch.rand(p, b, 1, generator=g) * 2 - 1,
        reward=torch.randn(p, b, generator=g),
        next_obs=torch.randn(p, b, 3, generator=g),
        terminated=(torch.rand(p, b, generator=g) < 0.2).float(),
    )


@pytest.mark.parametrize("autotune", [True, False])
def test_a_batched_update_equals_p_single_sac_updates(autotune: bool) -> None:
    """Three updates of a population of three agents with different learning rates, γ, τ, α
    and target entropies give each agent the weights, targets, temperature and Adam state
    that ``SAC.update`` gives it on the same batches and the same noise draws."""
    singles, stacked = agents(autotune), agents(autotune)
    population = PopulationSAC(stacked)
    p, b = len(singles), 64
    generators = [torch.Generator().manual_seed(100 + i) for i in range(p)]
    for k in range(3):
        batch = batches(p, b, seed=k)
        # SAC.update draws the next actions' noise first, then the current ones': the same
        # draws, then each generator back where it was for the single agent's update.
        states = [g.get_state() for g in generators]
        draws = [
            (torch.randn(b, 1, generator=g), torch.randn(b, 1, generator=g)) for g in generators
        ]
        for g, state in zip(generators, states, strict=True):
            g.set_state(state)
        stats = population.update(
            batch, noise=(torch.stack([d[0] for d in draws]), torch.stack([d[1] for d in draws]))
        )
        for i, agent in enumerate(singles):
            part = Batch(*(field[i] for field in batch))
            expected = agent.update(part, generators[i], k + 1)
            for name in ("critic_loss", "actor_loss", "alpha"):
                assert float(stats[name][i]) == pytest.approx(float(expected[name]), rel=1e-4)
    for i, agent in enumerate(singles):
        out = agents(autotune)[i]
        population.get(i, out)
        got, want = out.state_dict(), agent.state_dict()
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
        got_opt, want_opt = out.optimizer.state_dict(), agent.optimizer.state_dict()
        assert got_opt["param_groups"] == want_opt["param_groups"]
        for index, state in want_opt["state"].items():
            for key, value in state.items():
                torch.testing.assert_close(
                    got_opt["state"][index][key], value, rtol=1e-4, atol=1e-6, msg=key
                )


@pytest.mark.parametrize("algorithm", ["td3", "ddpg"])
def test_a_batched_update_equals_p_single_td3_or_ddpg_updates(algorithm: str) -> None:
    """Four updates (two of them TD3's delayed actor updates) of three agents with different
    learning rates, γ, τ and target smoothing give each agent the weights, targets and Adam
    state (the actor's step count its own) that ``TD3.update`` / ``DDPG.update`` gives it."""
    from services.pod.algorithms.ddpg import DDPG, DDPGConfig
    from services.pod.algorithms.td3 import TD3, TD3Config
    from services.pod.training.offpolicy_population import PopulationTD3

    cls, config_cls = (TD3, TD3Config) if algorithm == "td3" else (DDPG, DDPGConfig)
    hps = [
        {"learning_rate": 1e-3, "gamma": 0.99, "tau": 0.005},
        {"learning_rate": 3e-3, "gamma": 0.95, "tau": 0.02},
        {"learning_rate": 5e-4, "gamma": 0.9, "tau": 0.1},
    ]
    if algorithm == "td3":
        for hp, (sigma, clip) in zip(hps, ((0.2, 0.5), (0.1, 0.3), (0.3, 0.1)), strict=True):
            hp.update(policy_noise=sigma, noise_clip=clip)

    def make() -> list[Any]:
        out = []
        for i, hp in enumerate(hps):
            torch.manual_seed(i)
            out.append(cls(*spaces(), config_cls(hidden_sizes=[32, 32], **hp)))
        return out

    singles = make()
    population = PopulationTD3(make())
    p, b = len(singles), 64
    generators = [torch.Generator().manual_seed(100 + i) for i in range(p)]
    for k in range(1, 5):
        batch = batches(p, b, seed=k)
        states = [g.get_state() for g in generators]
        # TD3 draws its smoothing noise in its target; DDPG draws nothing.
        draws = [torch.randn(b, 1, generator=g) for g in generators]
        for g, state in zip(generators, states, strict=True):
            g.set_state(state)
        stats = population.update(batch, step=k, noise=torch.stack(draws))
        for i, agent in enumerate(singles):
            expected = agent.update(Batch(*(f[i] for f in batch)), generators[i], k)
            assert set(stats) == set(expected)
            for name, value in expected.items():
                assert float(stats[name][i]) == pytest.approx(float(value), rel=1e-4)
    for i, agent in enumerate(singles):
        out = make()[i]
        population.get(i, out)
        for name, value in agent.state_dict().items():
            torch.testing.assert_close(out.state_dict()[name], value, rtol=1e-4, atol=1e-5)
        got, want = out.optimizer.state_dict(), agent.optimizer.state_dict()
        assert got["param_groups"] == want["param_groups"]
        assert got["state"].keys() == want["state"].keys()
        for index, state in want["state"].items():
            for key, value in state.items():
                torch.testing.assert_close(got["state"][index][key], value, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("double", "dueling"), [(False, False), (True, True)])
def test_a_batched_update_equals_p_single_dqn_updates(double: bool, dueling: bool) -> None:
    """Six updates of three DQN agents with different learning rates, γ, τ, target periods
    (soft every update, soft every 2nd, hard every 3rd) and gradient clipping (one clipped
    hard, one not at all), each on its own update count, give each agent the weights, targets
    and Adam state that ``DQN.update`` gives it on the same batches; each agent's ε is
    ``DQN.epsilon``."""
    from services.pod.algorithms.dqn import DQN, DQNConfig
    from services.pod.training.offpolicy_population import PopulationDQN

    env = make_env("CartPole-v1", 1)
    obs_space, action_space = env.single_observation_space, env.single_action_space
    env.close()
    hps = [
        {"learning_rate": 1e-3, "gamma": 0.99, "tau": 0.05, "target_update_every": 1},
        {"learning_rate": 3e-3, "gamma": 0.95, "tau": 0.2, "target_update_every": 2,
         "max_grad_norm": 0.05, "epsilon_start": 0.8, "exploration_steps": 100},
        {"learning_rate": 5e-4, "gamma": 0.9, "tau": 1.0, "target_update_every": 3,
         "max_grad_norm": None, "epsilon_end": 0.2, "exploration_steps": 1000},
    ]  # fmt: skip

    def make() -> list[DQN]:
        out = []
        for i, hp in enumerate(hps):
            torch.manual_seed(i)
            config = DQNConfig(hidden_sizes=[32, 32], double=double, dueling=dueling, **hp)
            out.append(DQN(obs_space, action_space, config))
        return out

    singles = make()
    population = PopulationDQN(make())
    p, b, offsets = len(singles), 64, (5, 1, 0)
    for k in range(1, 7):
        g = torch.Generator().manual_seed(k)
        batch = Batch(
            obs=torch.randn(p, b, 4, generator=g),
            action=torch.randint(0, 2, (p, b), generator=g),
            reward=torch.randn(p, b, generator=g),
            next_obs=torch.randn(p, b, 4, generator=g),
            terminated=(torch.rand(p, b, generator=g) < 0.2).float(),
        )
        # Each agent's own update count (a slot loaded from files goes on from theirs).
        stats = population.update(batch, step=torch.tensor([k + o for o in offsets]))
        for i, agent in enumerate(singles):
            expected = agent.update(Batch(*(f[i] for f in batch)), g, k + offsets[i])
            assert float(stats["loss"][i]) == pytest.approx(float(expected["loss"]), rel=1e-4)
    for i, agent in enumerate(singles):
        out = make()[i]
        population.get(i, out)
        want = agent.state_dict()
        assert out.state_dict().keys() == want.keys()
        for name, value in want.items():
            torch.testing.assert_close(out.state_dict()[name], value, rtol=1e-4, atol=1e-5)
        got_opt, want_opt = out.optimizer.state_dict(), agent.optimizer.state_dict()
        assert got_opt["param_groups"] == want_opt["param_groups"]
        for index, state in want_opt["state"].items():
            for key, value in state.items():
                torch.testing.assert_close(
                    got_opt["state"][index][key], value, rtol=1e-4, atol=1e-6
                )
    # The targets moved differently: agent 2 (hard, every 3rd) holds its online weights of
    # its update 6, agent 1's (soft, every 2nd, last at its update 6 of 7) lag behind.
    online, target = population.flat, population.targets
    torch.testing.assert_close(target[2], online[2])
    assert not torch.allclose(target[1], online[1])
    for steps in (0, 50, 5000):
        eps = population.epsilon(torch.full((p,), steps))
        assert eps.tolist() == [a.epsilon(steps) for a in singles]


def small(**change: Any) -> list[dict[str, Any]]:
    base = {
        **preset("sac", "Pendulum-v1"),
        "num_envs": 4,
        "learning_starts": 32,
        "batch_size": 16,
        "buffer_size": 500,
        "eval_episodes": 2,
    }
    return [{**base, "seed": i, "sac": {**base["sac"], **change}} for i in range(2)]


def build(raw: list[dict[str, Any]]) -> OffPolicyPopulationTrainer:
    cls = trainer_class(raw[0]["algorithm"], len(raw))
    assert cls is OffPolicyPopulationTrainer
    return cls([cls.config_class.model_validate(c) for c in raw])


def test_a_population_refuses_agents_that_do_not_share_their_networks() -> None:
    raw = small()
    raw[1] = {**raw[1], "sac": {**raw[1]["sac"], "hidden_sizes": [32, 32]}}
    with pytest.raises(HyperparameterError, match="sac.hidden_sizes differ between the agents"):
        build(raw)
    raw = small()
    raw[1] = {**raw[1], "batch_size": 32}
    with pytest.raises(HyperparameterError, match="batch_size differ between the agents"):
        build(raw)


@pytest.mark.parametrize("noise", ["ou", "pink"])
def test_a_population_explores_with_correlated_noise_and_takes_a_fresh_agent(noise: str) -> None:
    """Noise correlated in time runs over all P * num_envs sub-environments at once; a slot
    reset to a fresh agent (empty replay, counters from zero) trains on with the others."""
    trainer = build(small(action_noise=noise))
    try:
        while trainer.updates < 2:
            trainer.step()
        before = trainer.counters(0)
        trainer.reset(1, trainer.config(1).model_copy(update={"seed": 42}))
        assert trainer.counters(1) == type(before)(0, 0) and trainer.replay.size[1] == 0
        for _ in range(3):
            trainer.step()
        assert trainer.counters(0).updates > before.updates
        assert trainer.counters(1).env_steps == 3 * trainer.step_env_steps
        assert trainer.replay.size[1] == 3 * trainer.step_env_steps
        assert all(r.episodes for r in trainer.evaluate())
    finally:
        trainer.close()


def test_sac_and_dqn_populations_are_accepted_and_what_they_cannot_vary_is_refused() -> None:
    spec: dict[str, Any] = {
        "name": "sacpop",
        "env": {"name": "Pendulum-v1"},
        "algorithms": {"sac": 1},
        "population": {"agents_per_pod": 4},
        "search_space": {"learning_rate": {"type": "log_uniform", "low": 1e-4, "high": 1e-2}},
    }
    assert ExperimentSpec.model_validate(spec).population.agents_per_pod == 4
    varied = {**spec["search_space"], "batch_size": {"type": "choice", "values": [64, 256]}}
    with pytest.raises(ValidationError, match="search_space 'batch_size' cannot vary"):
        ExperimentSpec.model_validate({**spec, "search_space": varied})
    # DQN's population varies its ε schedule and target updates, not what shapes its network.
    dqn = {
        **spec,
        "env": {"name": "CartPole-v1"},
        "algorithms": {"dqn": 1},
        "search_space": {
            "epsilon_end": {"type": "uniform", "low": 0.01, "high": 0.1},
            "target_update_every": {"type": "choice", "values": [1, 10]},
        },
    }
    assert ExperimentSpec.model_validate(dqn).population.agents_per_pod == 4
    dueling = {**dqn["search_space"], "dueling": {"type": "choice", "values": [True, False]}}
    with pytest.raises(ValidationError, match="search_space 'dueling' cannot vary"):
        ExperimentSpec.model_validate({**dqn, "search_space": dueling})


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["sac", "td3"])
def test_a_population_solves_pendulum_within_the_single_agents_budget(algorithm: str) -> None:
    """Four agents, each on the single-agent test's budget (tests/pod/test_offpolicy.py,
    30,000 env steps), each with its own learning rate: every agent's best evaluation reaches
    -300 (a swing-up from the bottom costs about -350 at best)."""
    base = preset(algorithm, "Pendulum-v1")
    raw = [
        {
            **base,
            "seed": 1 + i,
            "eval_seed": 1234,
            "eval_episodes": 20,
            algorithm: {**base[algorithm], "learning_rate": lr},
        }
        for i, lr in enumerate((1e-3, 2e-3, 2e-3, 3e-3))
    ]
    # One thread, as a CPU pod runs: two OpenMP threads on a loaded 2-core machine spin while
    # waiting for each other and took over 10 minutes here, one thread about a minute.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    trainer = build(raw)
    best = [float("-inf")] * trainer.size
    try:
        while trainer.env_steps < 30_000 and min(best) < -300:
            trainer.step()
            if trainer.env_steps % 2048 < trainer.step_env_steps:
                scores = [r.mean for r in trainer.evaluate()]
                best = [max(b, s) for b, s in zip(best, scores, strict=True)]
    finally:
        trainer.close()
        torch.set_num_threads(threads)
    assert min(best) >= -300, f"best evaluations {best} within {trainer.env_steps} env steps"


@pytest.mark.slow
def test_a_dqn_population_solves_cartpole_within_the_presets_budget() -> None:
    """Two D3QN agents on the CartPole preset, each with its own learning rate and ε floor:
    within the preset's env-step budget per agent (60,000), one agent's evaluation reaches the
    preset's target (475)."""
    base = preset("dqn", "CartPole-v1")
    budget, target = base["total_env_steps"], base["target_return"]
    hps = ({"learning_rate": 2.3e-3}, {"learning_rate": 1.5e-3, "epsilon_end": 0.03})
    raw = [
        {**base, "seed": 1 + i, "eval_seed": 1234, "dqn": {**base["dqn"], **hp}}
        for i, hp in enumerate(hps)
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    trainer = build(raw)
    best = [float("-inf")] * trainer.size
    try:
        while trainer.env_steps < budget and max(best) < target:
            trainer.step()
            if trainer.env_steps % base["eval_every_steps"] < trainer.step_env_steps:
                scores = [r.mean for r in trainer.evaluate()]
                best = [max(b, s) for b, s in zip(best, scores, strict=True)]
    finally:
        trainer.close()
        torch.set_num_threads(threads)
    assert max(best) >= target, f"best evaluations {best} within {trainer.env_steps} env steps"


def test_a_sac_population_pod_exploits_a_single_sac_pods_files(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    """The pod runtime with a SAC population against the real leaderboard: every member is its
    own candidate, PBT's exploit copies a single SAC pod's files (weights, Adam state, replay
    buffer) into every member's slot, and the members then report as its children with its
    counters going on."""
    generator = {
        "strategy": "pbt",
        "options": {"ready_reports": 1, "ready_env_steps": 0, "quantile": 0.01},
    }
    spec: dict[str, Any] = {
        "name": "sac-population",
        "env": {"name": "Pendulum-v1"},
        "algorithms": {"sac": 1.0},
        "search_space": {
            "learning_rate": {"type": "log_uniform", "low": 1e-3, "high": 3e-3},
            "tau": {"type": "uniform", "low": 0.01, "high": 0.03},
        },
        "generator": generator,
        "population": {"agents_per_pod": 2},
        "round": {"env_steps": 1280},  # past learning_starts (1,024): updates every round
        "evaluation": {"episodes": 4},
        "top_k": 64,
    }
    register(leaderboard, "sp", spec)
    rt = runtime(leaderboard, "sp", spec, "pop-s", tmp_path)
    rt.start()
    trainer = rt.trainer
    assert isinstance(trainer, OffPolicyPopulationTrainer)

    # A parent from a single-agent SAC pod, trained past its learning start.
    config = pod_config(ExperimentSpec.model_validate(spec), {"learning_rate": 2e-3}, 777)
    parent = build_single(config)
    while parent.updates < 3:
        parent.step()
    parent.save(0, tmp_path / "parent")
    outside_id = submit_outside_parent(
        rt.client, tmp_path / "parent", "sac", {"learning_rate": 2e-3, "tau": 0.02}
    )

    rt.train_round()
    rt.report()
    rt.maybe_exploit()
    want = parent.agent.state_dict()  # type: ignore[attr-defined]
    for i, member in enumerate(rt.slots):
        assert member.parent_id == outside_id and member.generation == 1
        copy = SAC(*spaces(), SACConfig(**trainer.config(i).sac.model_dump()))
        trainer.population.get(i, copy)
        for name, value in copy.state_dict().items():
            torch.testing.assert_close(value, want[name], msg=name)
        assert trainer.replay.size[i] == len(parent.buffer)  # type: ignore[attr-defined]
        assert float(trainer.population.optimizer.steps[i]) == parent.updates
        # The explored hyperparameters, not the parent's, are what the slot trains with.
        assert float(trainer.population.hp["learning_rate"][i]) == pytest.approx(
            member.hyperparameters["learning_rate"]
        )
    rt.train_round()
    rt.report()
    rt.close()
    parent.close()
    with leaderboard.api() as api:
        board = api.get("/experiments/sp/leaderboard").json()["candidates"]
    children = [c for c in board if c["parent_id"] == outside_id]
    assert {c["pod_id"] for c in children} == {m.pod_id for m in rt.slots}
    directory = download(leaderboard, children[0], tmp_path / "child")
    counters = read_files(directory).documents["counters"]
    assert counters["env_steps"] == parent.env_steps + 1280


# -- the roles train as the inline loop did ------------------------------------------------------
def tiny(algorithm: str, **loop: Any) -> list[dict[str, Any]]:
    """Two agents of ``algorithm`` with their own learning rates and τ (DQN: ε floors and target
    periods too), a fractional update-to-data ratio, a replay ring that wraps, and (Pendulum)
    episodes of 25 steps."""
    env = "CartPole-v1" if algorithm == "dqn" else "Pendulum-v1"
    base = {
        **preset(algorithm, env),
        "num_envs": 4,
        "learning_starts": 32,
        "batch_size": 16,
        "buffer_size": 256,
        "updates_per_step": 0.375,
        "eval_episodes": 2,
        "compile": "off",
        "env_kwargs": {} if algorithm == "dqn" else {"max_episode_steps": 25},
        **loop,
    }
    agent = {**base[algorithm], "hidden_sizes": [32, 32]}
    hps: list[dict[str, Any]] = [
        {"learning_rate": 1e-3, "tau": 0.02},
        {"learning_rate": 3e-3, "tau": 0.05},
    ]
    if algorithm == "dqn":  # ε decays within the run; the targets move on each slot's period
        hps[0] |= {"exploration_steps": 300, "target_update_every": 3}
        hps[1] |= {"exploration_steps": 500, "target_update_every": 5, "epsilon_end": 0.1}
    return [{**base, "seed": 3 + i, algorithm: {**agent, **hp}} for i, hp in enumerate(hps)]


def inline_loop(
    trainer: OffPolicyPopulationTrainer, steps: int, kstep: KStep | None = None
) -> tuple[list[Counters], float, dict[str, float]]:
    """``steps`` steps of ``trainer``'s agents, env, replay and generator by the loop the trainer
    wrote inline before it was built from roles (worker, learner): the reference its roles must
    match bit for bit. Returns each slot's counters, the update debt and the progress record."""
    cfg, p, n = trainer.config(0), trainer.size, trainer.step_env_steps
    pop, replay, gen, env = trainer.population, trainer.replay, trainer.generator, trainer.env
    offsets = [trainer.counters(i) for i in range(p)]  # its clock is at zero
    env_steps = updates = 0
    debt = 0.0
    returns = torch.zeros((), dtype=torch.float64)
    episodes = torch.zeros((), dtype=torch.int64)
    stats: dict[str, torch.Tensor] = {}

    def slot_counts(field: str, clock: int) -> torch.Tensor:
        return torch.tensor([getattr(o, field) + clock for o in offsets])

    obs, _ = env.reset(seed=cfg.seed)
    pop.end_episodes(torch.ones(p * n, dtype=torch.bool))
    for _ in range(steps):
        if env_steps < cfg.learning_starts:
            action = pop.template.random_action(p * n, gen).view(p, n, *pop.action_shape)
        else:
            action = pop.explore(obs.view(p, n, -1), gen, slot_counts("env_steps", env_steps))
        flat = action.reshape(p * n, *pop.action_shape)
        next_obs, reward, terminated, truncated, info = env.step(pop.template.to_env(flat))
        final = info["final_obs"].view(p, n, -1)
        replay.add(obs.view(p, n, -1), action, reward.view(p, n), final, terminated.view(p, n))
        obs = next_obs
        returns += info["episode_return"].sum()
        done = terminated | truncated
        episodes += done.sum()
        pop.end_episodes(done)
        env_steps += n
        if env_steps < cfg.learning_starts:
            continue
        debt += n * cfg.updates_per_step
        if kstep is not None:  # DQN's is newer than the loop: it numbers each slot's own
            while debt >= cfg.updates_per_call:
                debt -= cfg.updates_per_call
                dqn = isinstance(pop, PopulationDQN)
                done = slot_counts("updates", updates) if dqn else None
                stats = kstep(cfg.updates_per_call, updates + 1, done)
                updates += cfg.updates_per_call
            continue
        owed = int(debt)
        debt -= owed
        for _ in range(owed):
            updates += 1
            batch = replay.sample(cfg.batch_size, gen)
            dqn = isinstance(pop, PopulationDQN)
            stats = pop.update(batch, gen, slot_counts("updates", updates) if dqn else updates)
    record = {k: float(v.mean()) for k, v in stats.items()}
    if int(episodes):
        record["train_return"] = float(returns) / int(episodes)
    counters = [Counters(o.env_steps + env_steps, o.updates + updates) for o in offsets]
    return counters, debt, record


def eager_k_step(trainer: OffPolicyPopulationTrainer) -> KStep:
    """The trainer's K-step update, run eagerly (compiling it takes minutes on a CPU)."""
    kstep = trainer.learner.kstep
    assert kstep is not None
    kstep.compile = False
    return kstep


@pytest.mark.parametrize(
    ("algorithm", "k"), [("sac", 0), ("td3", 0), ("dqn", 0), ("sac", 4), ("td3", 3), ("dqn", 4)]
)
def test_the_roles_train_exactly_as_the_inline_loop_did(
    algorithm: str, k: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A population whose slot 1 was loaded from files 80 env steps and some updates on (so its
    counters, which DQN's ε schedule and target period run on, are offset from the others'),
    trained 60 steps (k: K updates per call, the compiled path's schedule, run eagerly), ends
    with the weights, Adam state, replay, random stream, counters, update debt and progress of
    the inline loop's run from the same start."""
    raw = tiny(algorithm, **({"updates_per_call": k} if k else {}))
    parent = build(raw)
    for _ in range(20):
        parent.step()
    parent.save(0, tmp_path / "parent")
    parent.close()
    if k:
        monkeypatch.setattr(offpolicy_population, "compile_updates", lambda *_: True)
    ours, reference = build(raw), build(raw)
    for trainer in (ours, reference):
        trainer.load(1, tmp_path / "parent", trainer.config(1))
    try:
        if k:
            eager_k_step(ours)
        for _ in range(60):
            ours.step()
        kstep = eager_k_step(reference) if k else None
        counters, debt, record = inline_loop(reference, 60, kstep)
        assert [ours.counters(i) for i in range(2)] == counters
        assert counters[1].env_steps == 80 + 240 and counters[0].updates >= 76
        assert ours.progress() == record and "train_return" in record
        for i in range(2):
            ours.save(i, tmp_path / f"ours{i}")
            reference.save(i, tmp_path / f"reference{i}")
            got, want = read_files(tmp_path / f"ours{i}"), read_files(tmp_path / f"reference{i}")
            assert got.tensors.keys() == want.tensors.keys()
            for name, tensors in want.tensors.items():
                for key, value in tensors.items():
                    assert torch.equal(got.tensors[name][key], value), f"slot {i}: {name}.{key}"
            assert got.documents["counters"] == {
                "env_steps": counters[i].env_steps,
                "updates": counters[i].updates,
                "update_debt": debt,
            }
    finally:
        ours.close()
        reference.close()


class _HostTensors(TorchDispatchMode):
    """Records each tensor made from host data (``torch.tensor`` of Python numbers): on an
    accelerator, a copy from the host, and a wait for it, on every call."""

    _MADE = frozenset({"lift_fresh", "lift_fresh_copy"})

    def __init__(self) -> None:
        super().__init__()
        self.made: list[str] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not self.paused and func.overloadpacket.__name__ in self._MADE:
            self.made.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("algorithm", ["sac", "dqn"])
def test_a_step_makes_no_tensor_from_host_counters(algorithm: str, tmp_path: Path) -> None:
    """Each slot's counters (DQN's ε schedule and target period run on them, a loaded slot's
    offset included) and the replay's write positions stay on the device: the trainer made a
    (P,) tensor of each from Python ints every env step (and every DQN update)."""
    raw = tiny(algorithm)
    parent = build(raw)
    for _ in range(10):
        parent.step()
    parent.save(0, tmp_path / "parent")
    parent.close()
    trainer = build(raw)
    try:
        trainer.load(1, tmp_path / "parent", trainer.config(1))  # 40 env steps ahead
        for _ in range(10):  # past learning_starts: the steps explore and update
            trainer.step()
        with _HostTensors() as mode:
            updates = trainer.updates
            for _ in range(3):
                trainer.step()
        assert trainer.updates > updates
        assert mode.made == []
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_compiled_dqn_population_trains_and_a_slot_loads_into_a_single_dqn_pod(
    tmp_path: Path,
) -> None:
    """``compile: on`` reaches a DQN population pod end to end: its learner pays the owed
    updates ``updates_per_call`` at a time through the compiled K-step update, nothing falls
    back, and a slot's training files load into a single-agent DQN pod with the slot's weights."""
    from structlog.testing import capture_logs

    from services.pod.training.offpolicy import OffPolicyConfig, OffPolicyTrainer

    raw = tiny("dqn", compile="on", updates_per_call=3)
    trainer = build(raw)
    try:
        assert trainer.learner.kstep is not None
        with capture_logs() as logs:
            for _ in range(40):
                trainer.step()
        assert not [e for e in logs if e["event"].startswith("compile.")], logs
        assert trainer.updates > 0 and trainer.updates % 3 == 0
        assert torch.equal(trainer.learner.slot_updates, torch.full((2,), trainer.updates))
        trainer.save(1, tmp_path / "slot")
        config = OffPolicyConfig.model_validate({**raw[1], "compile": "off"})
        single = OffPolicyTrainer([config])
        try:
            single.load(0, tmp_path / "slot", config)
            slot = trainer._view(config).agent
            trainer.population.get(1, slot)
            for name, value in slot.state_dict().items():
                torch.testing.assert_close(single.agent.state_dict()[name], value, msg=name)
        finally:
            single.close()
    finally:
        trainer.close()
