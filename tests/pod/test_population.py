"""PPO for P agents (services/pod/algorithms/ppo.py, run by services/pod/roles/learner.py): its
update is PPO written the obvious way (torch's distributions, modules and Adam), P batched
agents train exactly as P agents alone (every random draw is its agent's own), every env and
action kind, and a population learns."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Categorical, Normal

from services.pod.algorithms import ppo
from services.pod.algorithms.ppo import PPO, PPOConfig
from services.pod.config import PPORunConfig
from services.pod.roles.learner import PPOEnvs, PPOLearner, per_agent
from services.pod.training.fit import train
from services.pod.training.presets import preset

HPS = [
    {"learning_rate": 1e-3, "ent_coef": 0.01, "clip_coef": 0.2, "gamma": 0.99},
    {"learning_rate": 3e-3, "ent_coef": 0.0, "clip_coef": 0.1, "gamma": 0.9, "vf_coef": 1.0},
    {"learning_rate": 5e-4, "gae_lambda": 0.8, "max_grad_norm": 0.1},
]


def learner(env: str, config: PPOConfig, hps: list[dict], seeds: list[int], **kwargs) -> PPOLearner:
    """A learner of ``len(seeds)`` agents on ``env``, agent i built as a single agent with
    seed ``seeds[i]`` and ``hps[i]``."""
    run = PPORunConfig(env=env, env_kwargs=kwargs, ppo=config, eval_episodes=2)
    envs = PPOEnvs.build(run, len(seeds))
    spaces = envs.spaces()
    agents = []
    for seed, hp in zip(seeds, hps, strict=True):
        torch.manual_seed(seed)
        agents.append(PPO(*spaces, config.model_copy(update=hp)))
    return PPOLearner(
        envs.train, config, agents, [per_agent(a.config) for a in agents], seeds,
        total_env_steps=2_000, device=torch.device("cpu"),
        max_episode_steps=envs.train.max_episode_steps,
    )  # fmt: skip


CASES = [
    ("CartPole-v1", {}, {}),
    ("Pendulum-v1", {"norm_reward": True, "clip_vloss": True, "action_bounds": "squash"}, {}),
    ("Pendulum-v1", {"sde_sample_freq": 4, "log_std_init": -1.0, "norm_reward": True}, {}),
    ("Acrobot-v1", {"activation": "relu", "norm_obs": False, "target_kl": 0.01}, {}),
    ("MountainCarContinuous-v0", {"activation": "elu", "log_std_init": -0.5}, {}),
    ("StockTrading-v0", {"num_minibatches": 2}, {"episode_length": 20, "num_stocks": 2}),
]


@pytest.mark.parametrize(("env", "extra", "kwargs"), CASES, ids=[c[0] for c in CASES])
def test_p_batched_agents_train_as_p_agents_alone(env: str, extra: dict, kwargs: dict) -> None:
    """Three agents with their own hyperparameters and seeds, trained together for three
    iterations (rollout, GAE, minibatch updates; gSDE's noise; the KL early stop), end with the
    weights, Adam state and statistics each would have trained to alone: no agent's draws or
    data reach another's."""
    fields = {"num_envs": 4, "num_steps": 16, "num_minibatches": 4, "update_epochs": 3}
    config = PPOConfig(**{**fields, "hidden_sizes": [16, 16], **extra})
    seeds = [7, 8, 9]
    together = learner(env, config, HPS, seeds, **kwargs)
    alone = [
        learner(env, config, [hp], [seed], **kwargs) for hp, seed in zip(HPS, seeds, strict=True)
    ]
    for _ in range(3):
        together.iterate()
        for single in alone:
            single.iterate()
    for key, value in together.state.items():
        if key == "iteration":
            continue
        for i, single in enumerate(alone):
            torch.testing.assert_close(
                value[i], single.state[key][0], rtol=1e-4, atol=1e-5, msg=key
            )
    # The agents did diverge from each other, not just from their initialisations.
    assert not torch.allclose(together.state["params"][0], together.state["params"][1])


def reference_iteration(agent: PPO, roll: dict, orders: torch.Tensor, optimizer) -> None:
    """One PPO update of one agent the obvious way: its modules, torch's distributions,
    ``torch.optim.Adam``, ``clip_grad_norm_``; ``roll`` one agent's rollout (T, N, ...), no
    truncations, no normalisation."""
    cfg = agent.config
    actor, critic = agent.policy.actor, agent.critic
    with torch.no_grad():
        values = critic(roll["obs"]).squeeze(-1)
        next_value = critic(roll["next_obs"]).squeeze(-1)
        adv, returns = ppo.gae(
            roll["rewards"], values, roll["terminated"], next_value, cfg.gamma, cfg.gae_lambda
        )
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    data = [flat(roll["obs"]), flat(roll["actions"]), flat(roll["logprobs"]), flat(adv),
            flat(returns), flat(values)]  # fmt: skip
    for epoch in range(cfg.update_epochs):
        for idx in orders[epoch].view(cfg.num_minibatches, -1):
            obs, actions, old_logp, a, ret, _ = (x[idx] for x in data)
            out = actor.net(obs)
            if isinstance(actor, type(agent.policy.actor)) and hasattr(actor, "log_std"):
                dist = Normal(out, actor.log_std.exp())
                logp, entropy = dist.log_prob(actions).sum(-1), dist.entropy().sum(-1)
            else:
                dist = Categorical(logits=out)
                logp, entropy = dist.log_prob(actions), dist.entropy()
            ratio = (logp - old_logp).exp()
            a = (a - a.mean()) / (a.std() + 1e-8)
            clipped = ratio.clamp(1 - cfg.clip_coef, 1 + cfg.clip_coef)
            pg = torch.max(-a * ratio, -a * clipped).mean()
            v = critic(obs).squeeze(-1)
            loss = (
                pg - cfg.ent_coef * entropy.mean() + cfg.vf_coef * 0.5 * (v - ret).square().mean()
            )
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(agent.trained().parameters()), cfg.max_grad_norm)
            optimizer.step()


@pytest.mark.parametrize("env", ["CartPole-v1", "MountainCarContinuous-v0"])
def test_the_update_is_ppo_written_the_obvious_way(env: str) -> None:
    """One iteration on a rollout without truncations: the batched update gives the weights
    torch's distributions, modules and Adam give one agent."""
    config = PPOConfig(
        num_envs=4, num_steps=16, num_minibatches=4, update_epochs=2, hidden_sizes=[16],
        norm_obs=False, anneal_lr=False,
    )  # fmt: skip
    run = learner(env, config, [HPS[0]], [3])
    roll = run.collect()
    roll["truncated"] = torch.zeros_like(roll["truncated"])  # the reference bootstraps none
    orders = ppo.shuffles(run.shape, run.state)[0]
    torch.manual_seed(3)
    agent = PPO(*PPOEnvs.build(PPORunConfig(env=env, ppo=config)).spaces(),
                config.model_copy(update=HPS[0]))  # fmt: skip
    optimizer = torch.optim.Adam(agent.trained().parameters(), lr=HPS[0]["learning_rate"], eps=1e-5)
    one = {k: v[:, 0] for k, v in roll.items() if k != "next_obs"}
    one["next_obs"] = roll["next_obs"][0]
    reference_iteration(agent, one, orders, optimizer)
    run.learn(roll)
    mine = run.agent(0, PPO(*agent_spaces(env, config), config))
    for name, value in agent.trained().state_dict().items():
        torch.testing.assert_close(mine.trained().state_dict()[name], value, rtol=1e-4, atol=1e-6)


def agent_spaces(env: str, config: PPOConfig):
    run = PPORunConfig(env=env, ppo=config)
    return PPOEnvs.build(run).spaces()


@pytest.mark.slow
def test_population_learns_cartpole() -> None:
    """Three CartPole agents of the preset with their own learning rates, trained together:
    each reaches the target within the single agent's budget."""
    base = preset("ppo", "CartPole-v1")
    config = PPORunConfig.model_validate({**base, "seed": 1})
    from services.pod.training.trainer import build_trainer

    configs = [
        config.model_copy(
            update={"seed": 1 + i, "ppo": config.ppo.model_copy(update={"learning_rate": lr})}
        )
        for i, lr in enumerate((8e-3, 5e-3, 1e-2))
    ]
    trainer = build_trainer(configs)
    best = [float("-inf")] * 3
    while trainer.env_steps < config.total_env_steps and min(best) < 475:
        trainer.step()
        if trainer.env_steps % config.eval_every_steps < trainer.step_env_steps:
            best = [max(b, r.mean) for b, r in zip(best, trainer.evaluate(), strict=True)]
    assert min(best) >= 475, f"best evaluations {best} within {trainer.env_steps} env steps"
    result = train(config)  # the single agent of the same preset, for the record
    assert result.solved_at_env_steps is not None
