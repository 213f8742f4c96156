"""Worker, learner and evaluator through their small interfaces."""

from __future__ import annotations

import torch

from services.pod.config import PPORunConfig
from services.pod.training.presets import preset
from tests.pod.harness import ppo_roles


def roles(env: str = "Pendulum-v1", **ppo):
    cfg = PPORunConfig.model_validate(
        {**preset("ppo", env), "seed": 3, "eval_episodes": 6, "ppo": {"num_envs": 8, **ppo}}
    )
    return cfg, *ppo_roles(cfg)


def test_rollout_shapes_and_bookkeeping():
    _, worker, _, _ = roles(num_steps=250)  # > 200: every Pendulum episode is truncated once
    r = worker.collect()
    assert r.obs.shape == (250, 8, 3) and r.actions.shape == (250, 8, 1)
    assert r.logprobs.shape == r.rewards.shape == r.terminated.shape == (250, 8)
    assert not r.terminated.any()  # Pendulum never terminates...
    assert r.truncated[199].all() and r.truncated.sum() == 8  # ...it is truncated at 200
    assert r.episode_returns.shape == (8,) and (r.episode_lengths == 200).all()
    # The episode return is the sum of the raw rewards of that episode.
    torch.testing.assert_close(r.episode_returns, r.rewards[:200].sum(0), rtol=1e-5, atol=1e-3)
    # final_obs differs from the next obs exactly where an episode ended.
    assert not torch.equal(r.final_obs[199], r.obs[200])
    torch.testing.assert_close(r.final_obs[10], r.obs[11])
    assert r.env_steps == 2000


def test_worker_data_stays_on_env_device():
    _, worker, _, _ = roles(num_steps=4)
    r = worker.collect()
    assert {t.device for t in (r.obs, r.actions, r.rewards, r.final_obs)} == {worker.env.device}


def test_truncated_steps_are_bootstrapped_from_final_obs():
    """A truncated step's target includes γ·V(final_obs); a terminated one's does not."""
    cfg, worker, learner, _ = roles(num_steps=250, norm_reward=False, update_epochs=1)
    agent = learner.agent
    r = worker.collect()
    with torch.no_grad():
        # Make V(s) huge on the final observation only: the truncated step's advantage must
        # pick it up through the bootstrap term.
        v_final = agent.value(r.final_obs[199])
        v_next = agent.value(r.obs[200])
    assert not torch.allclose(v_final, v_next)
    from services.pod.algorithms.ppo import gae

    with torch.no_grad():
        values = agent.value(r.obs.reshape(-1, 3)).view(250, 8)
        rewards = r.rewards.clone()
        rewards[199] += cfg.ppo.gamma * v_final
        adv, _ = gae(
            rewards,
            values,
            r.truncated,
            agent.value(r.next_obs),
            cfg.ppo.gamma,
            cfg.ppo.gae_lambda,
        )
        expected_last = rewards[199] - values[199]  # episode boundary: no V(s_{t+1}) term
    torch.testing.assert_close(adv[199], expected_last)


def test_learner_is_the_only_writer_and_counts_steps():
    _, worker, learner, _ = roles(num_steps=16)
    before = {k: v.clone() for k, v in learner.policy_state().items()}
    stats = learner.update(worker.collect())
    after = learner.policy_state()
    assert learner.env_steps == 128 and learner.updates == 1
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert set(stats) >= {"pg_loss", "v_loss", "entropy", "approx_kl", "clipfrac", "lr"}
    # A second worker built from a snapshot acts exactly like the learner's policy.
    _, other_worker, _, _ = roles(num_steps=16)
    other_worker.load_policy(after)
    obs = torch.randn(5, 3)
    torch.testing.assert_close(
        other_worker.policy.act_deterministic(obs), learner.policy.act_deterministic(obs)
    )


def test_evaluator_is_deterministic_and_keeps_best():
    _, _, learner, evaluator = roles()
    first = evaluator.evaluate(learner.policy)
    second = evaluator.evaluate(learner.policy)
    assert len(first.episodes) == 6 and first.episodes == second.episodes
    assert first.env_steps >= 6 * 200
    best_state = evaluator.best_policy_state
    with torch.no_grad():
        for p in learner.policy.parameters():
            p.add_(torch.randn_like(p))
    worse_or_better = evaluator.evaluate(learner.policy)
    if worse_or_better.mean > first.mean:
        assert evaluator.best is worse_or_better
    else:
        assert evaluator.best is first
        for key, value in best_state.items():
            assert torch.equal(evaluator.best_policy_state[key], value)
