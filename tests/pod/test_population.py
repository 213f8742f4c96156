"""Vectorised populations: P batched agents equal P sequential PPO agents, and they learn."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.contracts.algorithms.hyperparameters import HyperparameterError
from services.pod.algorithms.ppo import PPO, PPOConfig
from services.pod.config import PPORunConfig
from services.pod.envs import make_env
from services.pod.roles.evaluator import Evaluator
from services.pod.roles.learner import RolloutLearner
from services.pod.training.onpolicy import load_ppo_files, save_ppo_files
from services.pod.training.population import PopulationPPO, build_population
from services.pod.training.population_trainer import check_population_config
from tests.pod.harness import run_fresh_python

HPS = [
    {"learning_rate": 1e-3, "ent_coef": 0.01, "clip_coef": 0.2, "gamma": 0.99},
    {"learning_rate": 3e-3, "ent_coef": 0.0, "clip_coef": 0.1, "gamma": 0.9, "vf_coef": 1.0},
    {"learning_rate": 5e-4, "gae_lambda": 0.8},
]


def _sequential_agents(pop: PopulationPPO, config: PPOConfig, seed: int) -> list[PPO]:
    """The agents a sequential run would build: PPO with agent i's values, seeded seed + i."""
    agents = []
    for i, hp in enumerate(HPS):
        torch.manual_seed(seed + i)
        space = pop.env.single_observation_space, pop.env.single_action_space
        agents.append(PPO(*space, config.model_copy(update=hp)))
    return agents


@pytest.mark.parametrize(
    ("env", "extra"),
    [
        ("CartPole-v1", {}),
        ("Pendulum-v1", {"norm_reward": True, "clip_vloss": True, "action_bounds": "squash"}),
        ("Acrobot-v1", {"activation": "relu", "norm_obs": False}),
        ("MountainCarContinuous-v0", {"activation": "elu", "log_std_init": -0.5}),
    ],
)
def test_population_equals_sequential_ppo_agents(env: str, extra: dict) -> None:
    """Same seeds, same rollouts: the population update gives PPO.update's weights, statistics
    and optimiser state, agent by agent, with each agent's own hyperparameters."""
    total = 2_000
    config = PPOConfig(
        num_envs=4, num_steps=16, num_minibatches=1, update_epochs=3, hidden_sizes=[16, 16], **extra
    )
    pop = build_population(env, config, HPS, seed=7, total_env_steps=total, eval_episodes=2)
    agents = _sequential_agents(pop, config, seed=7)
    for _ in range(4):
        rollout = pop.collect()
        lr_fraction = 1.0 - pop.env_steps / total
        stats = pop.update(rollout)
        for i, agent in enumerate(agents):
            expected = agent.update(rollout.agent(i), lr_fraction=lr_fraction)
            assert stats[i]["lr"] == pytest.approx(expected["lr"])
            assert stats[i]["v_loss"] == pytest.approx(expected["v_loss"], rel=1e-4, abs=1e-6)
    for i, agent in enumerate(agents):
        mine = pop.agent(i)
        theirs = agent.state_dict()
        for key, value in mine.state_dict().items():
            torch.testing.assert_close(value, theirs[key], rtol=1e-5, atol=1e-6, msg=key)
        for p_mine, p_theirs in zip(mine.parameters(), agent.parameters(), strict=True):
            s_mine, s_theirs = mine.optimizer.state[p_mine], agent.optimizer.state[p_theirs]
            torch.testing.assert_close(s_mine["exp_avg"], s_theirs["exp_avg"], atol=1e-6, rtol=1e-5)
            assert float(s_mine["step"]) == float(s_theirs["step"])
    # The agents did diverge from each other (different hyperparameters), not just from init.
    first, second = pop.agent(0).state_dict(), pop.agent(1).state_dict()
    assert not torch.allclose(first["critic.0.weight"], second["critic.0.weight"])

    # Each agent acts on its own slice of the batched env with its own weights.
    raw = torch.randn(len(HPS), 5, *pop.env.single_observation_space.shape)
    batched = pop._deterministic(raw)
    for i in range(len(HPS)):
        torch.testing.assert_close(batched[i], pop.agent(i).policy.act_deterministic(raw[i]))


def test_minibatch_update_keeps_agents_independent() -> None:
    """With shuffled minibatches, what one agent sees never moves another agent's weights."""
    config = PPOConfig(num_envs=4, num_steps=8, num_minibatches=4, update_epochs=2)
    results = []
    for perturb in (False, True):
        pop = build_population("CartPole-v1", config, HPS, seed=1, eval_episodes=1)
        rollout = pop.collect()
        if perturb:
            rollout.rewards[1] += 5.0
            rollout.obs[2] *= -1
        pop.update(rollout)
        results.append(pop.flat.clone())
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    assert not torch.equal(results[0][1], results[1][1])
    assert not torch.equal(results[0][2], results[1][2])


def test_candidates_round_trip_through_training_files(tmp_path: Path) -> None:
    config = PPOConfig(num_envs=4, num_steps=8, num_minibatches=2, update_epochs=1)
    pop = build_population("CartPole-v1", config, HPS, seed=2, total_env_steps=10_000)
    pop.update(pop.collect())
    results = pop.evaluate()
    assert len(results) == len(HPS) and all(r.episodes for r in results)
    i = 1
    train_config = PPORunConfig(env="CartPole-v1", ppo=pop.config(i), seed=2 + i)
    save_ppo_files(tmp_path / "candidate", pop.learner(i), train_config)
    env = make_env("CartPole-v1", 1)
    agent = PPO(env.single_observation_space, env.single_action_space, pop.config(i))
    fresh = RolloutLearner(agent, 1)
    load_ppo_files(tmp_path / "candidate", fresh)
    for key, value in pop.agent(i).state_dict().items():
        torch.testing.assert_close(fresh.agent.state_dict()[key], value, msg=key)
    assert fresh.env_steps == pop.env_steps == 32
    assert pop.hyperparameters[i]["learning_rate"] == pytest.approx(3e-3)

    # The restored agent goes into slot 0 of another population (PBT's exploit), with a new
    # learning rate (explore); the other slots are untouched.
    other = build_population("CartPole-v1", config, HPS, seed=9, eval_episodes=1)
    before = other.flat.clone()
    other.set_agent(0, fresh.agent, {"learning_rate": 7e-4})
    for key, value in fresh.agent.state_dict().items():
        torch.testing.assert_close(other.agent(0).state_dict()[key], value, msg=key)
    assert other.hyperparameters[0]["learning_rate"] == pytest.approx(7e-4)
    assert float(other.lr[0]) == pytest.approx(7e-4)
    assert torch.equal(other.flat[1:], before[1:])
    # Adam's step count came along (1 epoch x 2 minibatches), so the bias correction goes on
    # from the parent's; the other slots are still at 0.
    assert other.adam_steps.tolist() == [2.0, 0.0, 0.0]
    other.update(other.collect())
    assert other.adam_steps.tolist() == [4.0, 2.0, 2.0]
    assert float(other.agent(0).optimizer.state_dict()["state"][0]["step"]) == 4.0


def test_copying_a_slot_is_putting_that_slots_agent_there() -> None:
    """PBT's exploit inside the population (``copy_agent``) leaves the population exactly as
    ``set_agent`` of the standalone agent would: weights, statistics, Adam moments and step
    count from the source, the new hyperparameters on the destination's own; and the two
    train on identically."""
    config = PPOConfig(num_envs=4, num_steps=8, num_minibatches=2, update_epochs=1)
    pops = [build_population("CartPole-v1", config, HPS, seed=5) for _ in range(2)]
    for pop in pops:
        for _ in range(2):
            pop.update(pop.collect())
    by_agent, by_copy = pops
    by_agent.set_agent(2, by_agent.agent(0), {"ent_coef": 0.02})
    by_copy.copy_agent(2, 0, {"ent_coef": 0.02})
    assert by_copy.adam_steps.tolist() == [4.0, 4.0, 4.0]
    assert by_copy.hyperparameters == by_agent.hyperparameters
    assert by_copy.hyperparameters[2]["learning_rate"] == HPS[2]["learning_rate"]
    assert by_copy.hyperparameters[2]["ent_coef"] == 0.02
    torch.testing.assert_close(by_copy.flat[2], by_copy.flat[0])
    for pop in pops:
        pop.update(pop.collect())
    for mine, theirs in (
        (by_copy.flat, by_agent.flat),
        (by_copy.adam.exp_avg_sq, by_agent.adam.exp_avg_sq),
        (by_copy.obs_rms[0], by_agent.obs_rms[0]),
        (by_copy.return_rms[1], by_agent.return_rms[1]),
    ):
        torch.testing.assert_close(mine, theirs)


def test_every_agent_is_evaluated_like_a_single_pod() -> None:
    """The same weights in every slot score the same, on the start states that a single
    pod's ``Evaluator`` (same episodes, same seed) uses, so a member's score is the one a pod
    training it alone would report."""
    config = PPOConfig(num_envs=4, num_steps=16, num_minibatches=1, update_epochs=2)
    pop = build_population("CartPole-v1", config, HPS, seed=3, eval_episodes=6)
    for _ in range(3):
        pop.update(pop.collect())
    agent = pop.agent(1)
    for i in (0, 2):
        pop.set_agent(i, agent)
    results = pop.evaluate(seed=1234)
    assert results[0].episodes == results[1].episodes == results[2].episodes
    single = Evaluator(make_env("CartPole-v1", 6, seed=99), seed=1234).evaluate(agent.policy)
    assert results[1].mean == pytest.approx(single.mean, rel=0.02)
    assert len(set(single.episodes)) > 1  # different start states within an evaluation


def test_a_population_trains_without_building_optimisers_it_never_steps() -> None:
    """The population steps its agents with one batched Adam of its own: building and training
    it in a fresh process builds no torch.optim optimiser, so it never imports torch._dynamo
    (a process's first optimiser does, ~1 CPU s of a tournament's start-up)."""
    code = (
        "import sys\n"
        "from services.pod.algorithms.ppo import PPOConfig\n"
        "from services.pod.training.population import build_population\n"
        "cfg = PPOConfig(num_envs=4, num_steps=8, num_minibatches=2, update_epochs=1)\n"
        "pop = build_population('CartPole-v1', cfg, [{}, {}], eval_episodes=2)\n"
        "pop.update(pop.collect())\n"
        "pop.evaluate()\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'\n"
        "agent = pop.agent(0)  # a standalone agent with its Adam state: now it has one\n"
        "assert agent.optimizer.state and 'torch._dynamo' in sys.modules\n"
    )
    run_fresh_python(code)


def test_tanh_takes_the_cpus_faster_kernel_and_agrees_with_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.pod.training import population

    assert population.slow_tanh_cpu("processor\t: 0\nvendor_id\t: AuthenticAMD\n")
    assert not population.slow_tanh_cpu("processor\t: 0\nvendor_id\t: GenuineIntel\n")
    assert not population.slow_tanh_cpu("processor\t: 0\nBogoMIPS\t: 50.00\n")  # ARM
    x = torch.randn(4, 256, 64, generator=torch.Generator().manual_seed(0)) * 3
    for slow in (False, True):
        monkeypatch.setattr(population, "_slow_tanh", lambda slow=slow: slow)
        torch.testing.assert_close(population._tanh_(x.clone()), torch.tanh(x), atol=1e-6, rtol=0)


def test_bad_population_arguments_are_refused() -> None:
    config = PPOConfig(num_envs=2)
    env = make_env("CartPole-v1", 4)
    with pytest.raises(ValueError, match="per-agent hyperparameters can be"):
        PopulationPPO(env, config, [{"num_envs": 3}, {}], [0, 1])
    with pytest.raises(ValueError, match="P \\* num_envs = 6"):
        PopulationPPO(env, config, [{}, {}, {}], [0, 1, 2])
    with pytest.raises(ValueError, match="one seed per agent"):
        PopulationPPO(env, config, [{}, {}], [0])
    with pytest.raises(ValueError, match="gSDE"):
        PopulationPPO(env, config.model_copy(update={"sde_sample_freq": 4}), [{}, {}], [0, 1])
    with pytest.raises(ValueError, match="learning_rate"):
        PopulationPPO(env, config, [{"learning_rate": -1.0}, {}], [0, 1])


def test_a_gsde_refusal_names_the_preset_file_an_envpool_task_reads() -> None:
    """``envpool:<task>`` trains with ``<task>``'s preset, so the refusal names that file
    (it named ``presets/ppo/envpool:HalfCheetah-v5.yaml``, which does not exist)."""
    config = PPORunConfig(env="envpool:HalfCheetah-v5", ppo={"sde_sample_freq": 4})
    with pytest.raises(
        HyperparameterError, match=r"from the preset \S*/ppo/presets/HalfCheetah-v5\.yaml"
    ):
        check_population_config(config)


@pytest.mark.slow
def test_population_learns_cartpole() -> None:
    """Four agents with different learning rates and entropy bonuses, trained together within
    a budget of 40k env steps each, give four candidates: the best solves it and every one is
    far better than a random policy (~22). Which one is best depends on the CPU's float
    rounding (the preset's settings, agent 0, on an AMD EPYC; agent 2 on an Intel Xeon, where
    agent 0 scored 307.8), so the test asks what a tournament needs: one that solves."""
    torch.set_num_threads(1)
    config = PPOConfig(
        num_envs=16,
        num_steps=16,
        gamma=0.98,
        gae_lambda=0.8,
        num_minibatches=1,
        update_epochs=8,
        hidden_sizes=[32, 32],
        norm_obs=False,
    )
    hps = [
        {"learning_rate": lr, "ent_coef": ent}
        for lr, ent in ((8e-3, 0.0), (5e-3, 0.0), (8e-3, 0.01), (3e-3, 0.0))
    ]
    budget = 40_000
    pop = build_population("CartPole-v1", config, hps, seed=0, total_env_steps=budget)
    while pop.env_steps < budget:
        pop.update(pop.collect())
    scores = [r.mean for r in pop.evaluate()]
    assert len(scores) == 4
    assert max(scores) >= 475, scores
    assert min(scores) >= 100, scores
