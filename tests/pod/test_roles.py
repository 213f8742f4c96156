"""Worker, learner and evaluator through their small interfaces: the rollout PPO's learner
collects (services/pod/roles/worker.py), its update, its greedy evaluation."""

from __future__ import annotations

import pytest
import torch

from services.pod.algorithms import ppo
from services.pod.config import PPORunConfig
from services.pod.roles.evaluator import evaluate_groups
from services.pod.training.presets import preset
from tests.pod.harness import ppo_trainer


def trainer(env: str = "Pendulum-v1", **ppo_fields):
    cfg = PPORunConfig.model_validate(
        {**preset("ppo", env), "seed": 3, "eval_episodes": 6, "ppo": {"num_envs": 8, **ppo_fields}}
    )
    return cfg, ppo_trainer(cfg)


@pytest.mark.parametrize("env", ["Pendulum-v1", "gym:Pendulum-v1"])
def test_rollout_shapes_and_bookkeeping(env: str) -> None:
    """The same buffers from a functional env and a host-stepped one: (T, P, N, ...)."""
    _, t = trainer(env, num_steps=250)  # > 200: every Pendulum episode is truncated once
    r = t.population.collect()
    assert r["obs"].shape == (250, 1, 8, 3) and r["actions"].shape == (250, 1, 8, 1)
    assert r["logprobs"].shape == r["rewards"].shape == r["terminated"].shape == (250, 1, 8)
    assert not r["terminated"].any()  # Pendulum never terminates...
    assert r["truncated"][199].all() and r["truncated"].sum() == 8  # ...it is truncated at 200
    # The episode return, reported where it ended, is the sum of its raw rewards.
    torch.testing.assert_close(
        r["episode_return"][199], r["rewards"][:200].sum(0), rtol=1e-5, atol=1e-3
    )
    assert not r["episode_return"][:199].any() and r["next_obs"].shape == (1, 8, 3)
    # final_obs differs from the next obs exactly where an episode ended.
    assert not torch.equal(r["final_obs"][199], r["obs"][200])
    torch.testing.assert_close(r["final_obs"][10], r["obs"][11])


def test_worker_data_stays_on_env_device() -> None:
    _, t = trainer(num_steps=4)
    r = t.population.collect()
    assert {v.device for v in r.values()} == {t.device}


def test_truncated_steps_are_bootstrapped_from_final_obs() -> None:
    """A truncated step's target includes γ·V(final_obs); a terminated one's does not."""
    cfg, t = trainer(num_steps=250, norm_reward=False, update_epochs=1)
    learner = t.population
    roll = learner.collect()
    shape, state = learner.shape, learner.state
    params = shape.layout.views(state["params"])
    from services.pod.algorithms import policies as pi

    with torch.no_grad():
        v_final = pi.value(shape.policy, params, roll["final_obs"][199])
        v_next = pi.value(shape.policy, params, roll["obs"][200])
    assert not torch.allclose(v_final, v_next)
    b = ppo.batch(shape, state, roll, learner.hp)
    with torch.no_grad():
        values = pi.value(shape.policy, params, roll["obs"].reshape(1, -1, 3)).view(250, 1, 8)
        rewards = roll["rewards"].clone()
        rewards[199] += cfg.ppo.gamma * v_final
        adv, _ = ppo.gae(
            rewards, values, roll["truncated"], pi.value(shape.policy, params, roll["next_obs"]),
            cfg.ppo.gamma, cfg.ppo.gae_lambda,
        )  # fmt: skip
        expected_last = rewards[199] - values[199]  # episode boundary: no V(s_{t+1}) term
    torch.testing.assert_close(adv[199], expected_last)
    torch.testing.assert_close(b["advantages"].view(1, 250, 8).transpose(0, 1), adv)


@pytest.mark.parametrize("max_episode_steps", [3, 7, 200])
def test_values_of_only_the_truncated_final_observations_give_the_same_advantages(
    max_episode_steps: int,
) -> None:
    """The critic runs on the final observations of the steps that can truncate (a top-k of
    the flags, a static shape) instead of all of them: the same advantages."""
    _, t = trainer(num_steps=16, norm_reward=False)
    learner = t.population
    roll = learner.collect()
    roll["truncated"] = torch.zeros_like(roll["truncated"])
    roll["truncated"][max_episode_steps - 1 :: max_episode_steps] = True
    limited = ppo.PPOShape(**{**vars(learner.shape), "max_episode_steps": max_episode_steps})
    unlimited = ppo.PPOShape(**{**vars(learner.shape), "max_episode_steps": None})
    a = ppo.batch(limited, learner.state, roll, learner.hp)
    b = ppo.batch(unlimited, learner.state, roll, learner.hp)
    torch.testing.assert_close(a["advantages"], b["advantages"])


def test_learner_is_the_only_writer_and_counts_steps() -> None:
    _, t = trainer(num_steps=16)
    before = {k: v.clone() for k, v in t.population.state.items()}
    t.step()
    assert t.env_steps == 128 and t.updates == 1
    assert not torch.equal(before["params"], t.population.state["params"])
    assert set(t.progress()) >= {"pg_loss", "v_loss", "entropy", "approx_kl", "clipfrac", "lr"}
    # A single agent taken out of the state acts exactly as the state's policy does.
    agent = t.agent(0)
    obs = torch.randn(5, 3)
    torch.testing.assert_close(agent.policy.act_deterministic(obs), t.population.act(obs))


def test_evaluation_is_deterministic_and_scores_what_the_evaluator_scores() -> None:
    """The greedy evaluation of the functional env (one pure function) scores what the
    evaluator of a vector env of the episodes scores, from the same start states."""
    cfg, t = trainer()
    first, second = t.evaluate()[0], t.evaluate()[0]
    assert len(first.episodes) == 6 and first.episodes == second.episodes
    assert first.env_steps >= 6 * 200
    env, _ = cfg.make_envs(cfg.ppo.num_envs)
    _, eval_env = cfg.make_envs(cfg.ppo.num_envs)
    env.close()
    act = t.agent(0).policy.act_deterministic
    [result] = evaluate_groups(eval_env, act, seed=cfg.evaluation_seed)
    assert result.episodes == pytest.approx(first.episodes, rel=1e-4)
