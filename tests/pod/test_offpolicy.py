"""Off-policy agents: the replay buffer, TD targets, training files, config errors, learning."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from services.contracts.envs import target_return
from services.pod.algorithms.ddpg import DDPG, DDPGConfig
from services.pod.algorithms.ddpg import td_target as ddpg_target
from services.pod.algorithms.dqn import DQN, DQNConfig
from services.pod.algorithms.dqn import td_target as dqn_target
from services.pod.algorithms.noise import ActionNoise
from services.pod.algorithms.replay_buffer import Batch, ReplayBuffer
from services.pod.envs.registry import make_env
from services.pod.training.checkpoint import CheckpointError
from services.pod.training.fit import build, train
from services.pod.training.offpolicy import OffPolicyConfig
from services.pod.training.presets import preset


def rows(first: int, n: int) -> tuple[torch.Tensor, ...]:
    """n transitions whose every field encodes its row number (first, first + 1, ...)."""
    ids = torch.arange(first, first + n, dtype=torch.float32)
    obs = ids.unsqueeze(1).repeat(1, 3)
    return obs, ids.unsqueeze(1) * 10, ids * 100, obs + 0.5, (ids % 2 == 0)


# -- replay buffer --------------------------------------------------------------------------
def test_ring_overwrites_the_oldest_rows_in_order():
    buf = ReplayBuffer(5, (3,), (1,))
    buf.add(*rows(0, 2))
    assert (len(buf), buf.pos) == (2, 2)
    buf.add(*rows(2, 2))
    buf.add(*rows(4, 2))  # wraps: row 5 goes to slot 0
    assert (len(buf), buf.pos) == (5, 1)
    assert buf.obs[:, 0].tolist() == [5, 1, 2, 3, 4]
    buf.add(*rows(6, 7))  # more than the capacity: only the newest 5 survive
    assert buf.obs[:, 0].tolist() == [10, 11, 12, 8, 9]  # as if added one by one
    assert (len(buf), buf.pos) == (5, 3)
    ids = buf.obs[:, 0]
    torch.testing.assert_close(buf.action[:, 0], ids * 10)
    torch.testing.assert_close(buf.reward, ids * 100)
    torch.testing.assert_close(buf.next_obs[:, 0], ids + 0.5)
    assert buf.terminated.tolist() == [float(i % 2 == 0) for i in ids.tolist()]


def test_sample_draws_only_filled_slots_and_keeps_rows_together():
    buf = ReplayBuffer(1000, (3,), (1,))
    buf.add(*rows(1, 7))
    batch = buf.sample(4096, torch.Generator().manual_seed(0))
    ids = batch.obs[:, 0]
    assert set(ids.tolist()) == set(range(1, 8))  # every filled row, and only those
    torch.testing.assert_close(batch.action[:, 0], ids * 10)
    torch.testing.assert_close(batch.reward, ids * 100)
    torch.testing.assert_close(batch.next_obs[:, 1], ids + 0.5)
    with pytest.raises(ValueError, match="empty"):
        ReplayBuffer(4, (3,), (1,)).sample(2)


def test_truncated_episode_ends_keep_their_final_obs_and_are_not_terminal():
    """Collect from a real env with a short time limit: truncation must not cut bootstrapping."""
    env = make_env("CartPole-v1", 8, seed=0, max_episode_steps=9)
    buf = ReplayBuffer(1000, (4,), (), torch.int64)
    obs, _ = env.reset(seed=0)
    truncations = 0
    for _ in range(40):
        action = torch.randint(0, 2, (8,))
        action[:4] = 1  # always pushing right: the pole falls (terminates) within ~9 steps
        next_obs, reward, term, trunc, info = env.step(action)
        buf.add(obs, action, reward, info["final_obs"], term)
        row = slice(buf.pos - 8, buf.pos)
        assert torch.equal(buf.terminated[row].bool(), term)  # truncation is not termination
        assert torch.equal(buf.next_obs[row], info["final_obs"])
        ended = term | trunc
        if ended.any():  # the stored next obs is the finished episode's, not the reset one
            assert not torch.equal(buf.next_obs[row][ended], next_obs[ended])
        truncations += int(trunc.sum())
        obs = next_obs
    assert truncations > 0 and buf.terminated.sum() > 0


def test_td_targets_bootstrap_truncated_but_not_terminated_transitions():
    env = make_env("CartPole-v1", 1)
    dqn = DQN(env.single_observation_space, env.single_action_space, DQNConfig(gamma=0.9))
    params = dict(dqn.q.named_parameters())
    targets = dict(zip(params, dqn._targets, strict=True))
    obs = torch.randn(4, 4)
    batch = Batch(
        obs,
        torch.zeros(4, dtype=torch.int64),
        torch.tensor([1.0, 2.0, 3.0, 4.0]),
        obs + 1,
        torch.tensor([0.0, 1.0, 0.0, 1.0]),  # rows 0, 2: truncated (or not ended)
    )
    y = dqn_target(dqn.q, False, params, targets, torch.tensor(0.9), batch)
    v_next = dqn.q_target(batch.next_obs).amax(-1).detach()
    torch.testing.assert_close(y, batch.reward + 0.9 * v_next * (1 - batch.terminated))
    assert y[1] == 2.0 and y[3] == 4.0 and y[0] != 1.0

    penv = make_env("Pendulum-v1", 1)
    ddpg = DDPG(penv.single_observation_space, penv.single_action_space, DDPGConfig(gamma=0.9))
    names = dict(ddpg.actor.named_parameters())
    actor_t = dict(zip(names, ddpg.actor_target.parameters(), strict=True))
    critic_t = dict(ddpg.critic_target.named_parameters())
    pobs = torch.randn(2, 3)
    batch = Batch(pobs, torch.zeros(2, 1), torch.tensor([1.0, 2.0]), pobs, torch.tensor([0.0, 1]))
    hp = {"gamma": torch.tensor(0.9)}
    y = ddpg_target(
        ddpg.actor_target, ddpg.critic_target, False, actor_t, critic_t, hp, batch, None
    )
    q_next = ddpg.critic_target(pobs, ddpg.actor_target(pobs))[0].detach()
    torch.testing.assert_close(y, torch.stack([1.0 + 0.9 * q_next[0], torch.tensor(2.0)]))


# -- training files -------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["sac", "td3", "ddpg", "dqn"])
def test_training_files_round_trip_bit_exact(tmp_path, algorithm):
    env = "CartPole-v1" if algorithm == "dqn" else "Pendulum-v1"
    cfg = OffPolicyConfig.model_validate(
        {
            **preset(algorithm, env),
            "num_envs": 4,
            "total_env_steps": 160,
            "learning_starts": 64,
            "batch_size": 16,
            "buffer_size": 100,  # wraps within the run
            "updates_per_step": 0.3,
            "eval_every_steps": 10_000,
            "eval_episodes": 2,
            "target_return": None,
        }
    )
    trained = build(cfg)
    train(cfg, trainer=trained)
    trained.save(0, tmp_path / "ckpt")

    restored = build(cfg.model_copy(update={"seed": 99}))  # different weights, empty buffer
    restored.load(0, tmp_path / "ckpt", cfg)
    agents = []
    for trainer in (trained, restored):
        agent, buffer = trainer._single(cfg)
        trainer.population.get(0, agent)
        trainer.replay.get(0, buffer)
        agents.append((agent, buffer))
    (a_agent, a_buf), (b_agent, b_buf) = agents
    for a, b in zip(a_agent.state_dict().items(), b_agent.state_dict().items(), strict=True):
        assert a[0] == b[0] and torch.equal(a[1], b[1]), a[0]
    for name in ("obs", "action", "reward", "next_obs", "terminated"):
        assert torch.equal(getattr(a_buf, name), getattr(b_buf, name)), name
    assert (b_buf.pos, len(b_buf)) == (a_buf.pos, 100)
    assert restored.counters(0) == trained.counters(0)
    assert restored.learner.update_debt == trained.learner.update_debt
    # The same next update from both: optimiser state and the update's draws resume exactly.
    for trainer in (trained, restored):
        trainer.learner.kstep(1, trainer.updates + 1, False)
    for name, flat in trained.population.flats.items():
        assert torch.equal(flat, restored.population.flats[name]), name


def test_training_files_of_another_algorithm_are_refused(tmp_path):
    base = {**preset("td3", "Pendulum-v1"), "num_envs": 2, "eval_episodes": 1}
    cfg = OffPolicyConfig.model_validate(base)
    build(cfg).save(0, tmp_path / "td3")
    sac_cfg = OffPolicyConfig.model_validate({**base, "algorithm": "sac"})
    sac = build(sac_cfg)
    with pytest.raises(CheckpointError, match="checkpoint of 'td3'"):
        sac.load(0, tmp_path / "td3", sac_cfg)


# -- configuration --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("update", "field"),
    [
        ({"algorithm": "ppo"}, "algorithm"),
        ({"sac": {"learning_rate": -1}}, "sac.learning_rate"),
        ({"dqn": {"dueling": "sometimes"}}, "dqn.dueling"),
        ({"td3": {"lr": 1e-3}}, "td3.lr"),
        ({"updates_per_step": 0}, "updates_per_step"),
        ({"batch_sz": 64}, "batch_sz"),
    ],
)
def test_bad_config_is_a_validation_error_naming_the_field(update, field):
    with pytest.raises(ValidationError) as info:
        OffPolicyConfig.model_validate({**preset("sac", "Pendulum-v1"), **update})
    located = [".".join(map(str, e["loc"])) for e in info.value.errors()]
    assert field in located or any(field in e["msg"] for e in info.value.errors()), located


def test_action_space_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="sac needs a continuous"):
        build(OffPolicyConfig.model_validate({**preset("sac", "CartPole-v1"), "num_envs": 2}))
    with pytest.raises(ValueError, match="dqn needs a Discrete"):
        build(OffPolicyConfig.model_validate({**preset("dqn", "Pendulum-v1"), "num_envs": 2}))


# -- learning -------------------------------------------------------------------------------
def assert_solves(algorithm: str, env: str, budget: int, seed: int, **overrides):
    cfg = OffPolicyConfig.model_validate(
        {**preset(algorithm, env), "total_env_steps": budget, "seed": seed, **overrides}
    )
    result = train(cfg)
    assert result.best is not None
    assert result.best.mean >= target_return(env), (
        f"{algorithm} on {env}: best eval {result.best.mean:.1f} < {target_return(env)} "
        f"within {budget} env steps"
    )
    assert result.solved_at_env_steps is not None and result.solved_at_env_steps <= budget


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["sac", "td3", "ddpg"])
def test_continuous_agents_solve_pendulum_within_env_step_budget(algorithm):
    assert_solves(algorithm, "Pendulum-v1", 30_000, seed=1)


@pytest.mark.slow
@pytest.mark.nightly  # about a minute each; D3QN (both on), the preset, is in every run
@pytest.mark.parametrize(("double", "dueling"), [(False, False), (True, False), (False, True)])
def test_dqn_family_solves_cartpole_within_env_step_budget(double, dueling):
    """DQN without one or both of its preset's switches (test_presets_solve.py trains the
    preset, double and dueling, on CartPole and Acrobot)."""
    dqn = {**preset("dqn", "CartPole-v1")["dqn"], "double": double, "dueling": dueling}
    assert_solves("dqn", "CartPole-v1", 80_000, seed=1, dqn=dqn)


# -- exploration noise over time ------------------------------------------------------------
def noise_sequence(kind: str, steps: int, n: int = 256, **kwargs) -> torch.Tensor:
    """(steps, n) draws of one action dimension from ``ActionNoise``."""
    noise = ActionNoise(kind, (1,), **kwargs)
    gen = torch.Generator().manual_seed(0)
    return torch.stack([noise.sample(n, gen, torch.device("cpu"))[:, 0] for _ in range(steps)])


def lag_correlation(x: torch.Tensor, lag: int) -> float:
    return float((x[lag:] * x[:-lag]).mean() / x.var())


@pytest.mark.parametrize(
    ("kind", "kwargs"),
    [("white", {}), ("ou", {"correlation": 0.95}), ("pink", {"horizon": 200})],
)
def test_noise_has_unit_variance_and_its_kinds_correlation_in_time(kind, kwargs):
    x = noise_sequence(kind, 200, **kwargs)
    assert x.var().item() == pytest.approx(1.0, abs=0.1)
    one, five = lag_correlation(x, 1), lag_correlation(x, 5)
    if kind == "white":
        assert abs(one) < 0.02 and abs(five) < 0.02
    elif kind == "ou":  # an AR(1) process: ρ per step, ρ^5 over five
        assert one == pytest.approx(0.95, abs=0.02)
        assert five == pytest.approx(0.95**5, abs=0.03)
    else:  # 1/f: most power at low frequencies, so successive draws lean the same way
        assert one > 0.5 and five > 0.25


@pytest.mark.parametrize("kind", ["ou", "pink"])
def test_noise_starts_over_where_an_episode_ended(kind):
    noise = ActionNoise(kind, (1,), correlation=0.999, horizon=100)
    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    first = noise.sample(2000, gen, cpu)
    done = torch.zeros(2000, dtype=torch.bool)
    done[1000:] = True
    noise.reset(done)
    second = noise.sample(2000, gen, cpu)
    # Envs whose episode goes on keep their push; the others draw afresh (independent).
    kept = torch.corrcoef(torch.stack([first[:1000, 0], second[:1000, 0]]))[0, 1]
    fresh = torch.corrcoef(torch.stack([first[1000:, 0], second[1000:, 0]]))[0, 1]
    assert kept > 0.5 and abs(fresh) < 0.1


def test_ddpg_explores_with_the_noise_its_config_names():
    env = make_env("MountainCarContinuous-v0", 64, seed=0)
    obs, _ = env.reset(seed=0)
    gen = torch.Generator().manual_seed(0)
    pushes = {}
    for kind in ("white", "pink"):
        agent = DDPG(
            env.single_observation_space,
            env.single_action_space,
            DDPGConfig(action_noise=kind, exploration_noise=0.3),
        )
        actions = torch.stack([agent.explore(obs, gen, 10_000)[:, 0] for _ in range(50)])
        pushes[kind] = lag_correlation(actions - actions.mean(), 5)
    assert abs(pushes["white"]) < 0.1 and pushes["pink"] > 0.5
