"""Off-policy stacks and populations (services/pod/algorithms/stacked.py, services/pod/training/
offpolicy.py): P SAC (TD3, DDPG, DQN) agents stacked in one process update exactly as P single
agents do by their algorithm's own maths, written here the obvious way (one agent, its modules,
``torch.optim.Adam``); they keep each slot's counters on the device, refuse what they cannot
train, and learn Pendulum (DQN: CartPole). The save/load contract (a slot's files are a single
agent pod's) is in tests/pod/test_trainers.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch.utils._python_dispatch import TorchDispatchMode

from services.contracts.algorithms.hyperparameters import HyperparameterError
from services.contracts.spec import ExperimentSpec
from services.pod.algorithms.counter_random import draws, uniform
from services.pod.algorithms.ddpg import DDPG, DDPGConfig
from services.pod.algorithms.dqn import DQN, DQNConfig
from services.pod.algorithms.replay_buffer import Batch
from services.pod.algorithms.sac import SAC, SACConfig
from services.pod.algorithms.stacked import BATCH_STREAM, KStep, draw_batch
from services.pod.algorithms.td3 import TD3, TD3Config
from services.pod.envs.registry import make_env
from services.pod.training.checkpoint import read_files
from services.pod.training.fit import build as build_single
from services.pod.training.offpolicy import OffPolicyTrainer
from services.pod.training.presets import pod_config, preset
from services.pod.training.trainer import trainer_class
from tests.pod.harness import Leaderboard, download, register, runtime, submit_outside_parent

HPS = [
    {"learning_rate": 1e-3, "gamma": 0.99, "tau": 0.005, "init_alpha": 1.0},
    {"learning_rate": 3e-3, "gamma": 0.95, "tau": 0.02, "init_alpha": 0.5},
    {"learning_rate": 5e-4, "gamma": 0.9, "tau": 0.1, "init_alpha": 0.2, "target_entropy": -2.0},
]


def spaces(env: str = "Pendulum-v1") -> tuple[Any, Any]:
    made = make_env(env, 1)
    made.close()
    return made.single_observation_space, made.single_action_space


def replay_of(p: int, n: int, obs: int, discrete: bool, seed: int) -> tuple[tuple, torch.Tensor]:
    """P replay buffers of ``n`` random transitions each (all rows filled)."""
    g = torch.Generator().manual_seed(seed)
    action = (
        torch.randint(0, 2, (p, n), generator=g)
        if discrete
        else torch.rand(p, n, 1, generator=g) * 2 - 1
    )
    fields = (
        torch.randn(p, n, obs, generator=g),
        action,
        torch.randn(p, n, generator=g),
        torch.randn(p, n, obs, generator=g),
        (torch.rand(p, n, generator=g) < 0.2).float(),
    )
    return fields, torch.full((p,), n, dtype=torch.int64)


def drawn(kstep: KStep, b: int, streams: int, a: int = 1) -> tuple[Batch, list[torch.Tensor]]:
    """The batch and the normal draws (``streams`` of them) the next update of ``kstep``
    draws: the same counter-based functions, called before it does."""
    u = uniform(kstep.seed, kstep.counter, BATCH_STREAM, (b,))
    batch = draw_batch(kstep.replay, kstep.filled, u)
    shapes = {s: (b, a) for s in range(1, streams + 1)}
    noise = list(draws(kstep.seed, kstep.counter, {}, shapes)[1].values()) if shapes else []
    return batch, noise


def row(batch: Batch, i: int) -> Batch:
    return Batch(*(f[i] for f in batch))


@torch.no_grad()
def polyak_(target: list[torch.Tensor], online: list[torch.Tensor], tau: float) -> None:
    """θ' ← θ' + τ (θ − θ')."""
    for t, o in zip(target, online, strict=True):
        t.lerp_(o, tau)


@contextlib.contextmanager
def torch_adam(agent: Any) -> Iterator[torch.optim.Adam]:
    """The agent's Adam state in a ``torch.optim.Adam`` (its gradients cleared) for one step
    the obvious way; what it holds after goes back to the agent."""
    optimizer = torch.optim.Adam(agent.optimizer.params, lr=agent.optimizer.lr, fused=True)
    optimizer.load_state_dict(agent.optimizer.state_dict())
    optimizer.zero_grad(set_to_none=True)
    yield optimizer
    agent.optimizer.load_state_dict(optimizer.state_dict())


def reference_sac(agent: SAC, batch: Batch, eps_next: torch.Tensor, eps: torch.Tensor) -> dict:
    """One SAC update of one agent, the obvious way: its modules, autograd, its Adam."""
    cfg = agent.config
    alpha = agent.log_alpha.detach().exp()
    with torch.no_grad():
        next_action, next_logp = agent.actor.sample(batch.next_obs, eps=eps_next)
        q_next = agent.critic_target(batch.next_obs, next_action).amin(0)
        y = batch.reward + cfg.gamma * (1 - batch.terminated) * (q_next - alpha * next_logp)
    critic_loss = (agent.critic(batch.obs, batch.action) - y).square().mean(1).sum()
    action, logp = agent.actor.sample(batch.obs, eps=eps)
    actor_loss = (alpha * logp - agent.critic(batch.obs, action).amin(0)).mean()
    policy_loss = actor_loss
    if cfg.autotune_alpha:
        policy_loss = actor_loss - (agent.log_alpha * (logp.detach() + agent.target_entropy)).mean()
    with torch_adam(agent) as optimizer:
        critic_loss.backward(inputs=agent._critic_params)
        policy_loss.backward(inputs=agent._actor_params)
        optimizer.step()
    polyak_(agent._targets, agent._critic_params, cfg.tau)
    return {"critic_loss": critic_loss, "actor_loss": actor_loss, "alpha": alpha}


def reference_td3(agent: DDPG, batch: Batch, eps: torch.Tensor, step: int) -> dict:
    """One DDPG / TD3 update of one agent, the obvious way."""
    cfg = agent.config
    with torch.no_grad():
        a = agent.actor_target(batch.next_obs)
        if agent.smoothing:
            a = (a + (eps * cfg.policy_noise).clamp(-cfg.noise_clip, cfg.noise_clip)).clamp(-1, 1)
        q_next = agent.critic_target(batch.next_obs, a).amin(0)
        y = batch.reward + cfg.gamma * (1 - batch.terminated) * q_next
    critic_loss = (agent.critic(batch.obs, batch.action) - y).square().mean(1).sum()
    out = {"critic_loss": critic_loss}
    delayed = step % agent.policy_delay == 0
    with torch_adam(agent) as optimizer:
        critic_loss.backward(inputs=agent._critic_params)
        if delayed:
            actor_loss = -agent.critic(batch.obs, agent.actor(batch.obs))[0].mean()
            actor_loss.backward(inputs=agent._actor_params)
            out["actor_loss"] = actor_loss
        optimizer.step()  # skips the actor between delays: it has no gradient
    if delayed:
        polyak_(agent._targets, agent._online, cfg.tau)
    return out


def reference_dqn(agent: DQN, batch: Batch, step: int) -> dict:
    """One DQN update of one agent (update number ``step``), the obvious way."""
    cfg = agent.config
    with torch.no_grad():
        q_next = agent.q_target(batch.next_obs)
        if cfg.double:
            v_next = q_next.gather(-1, agent.q(batch.next_obs).argmax(-1, keepdim=True)).squeeze(-1)
        else:
            v_next = q_next.amax(-1)
        y = batch.reward + cfg.gamma * (1 - batch.terminated) * v_next
    q = agent.q(batch.obs).gather(-1, batch.action.unsqueeze(-1)).squeeze(-1)
    loss = F.smooth_l1_loss(q, y)
    with torch_adam(agent) as optimizer:
        loss.backward()
        if cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(agent._params, cfg.max_grad_norm)
        optimizer.step()
    if step % cfg.target_update_every == 0:
        polyak_(agent._targets, agent._params, cfg.tau)
    return {"loss": loss}


def assert_same_agent(got: Any, want: Any) -> None:
    assert got.state_dict().keys() == want.state_dict().keys()
    for name, value in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[name], value, rtol=1e-4, atol=1e-5, msg=name)
    got_opt, want_opt = got.optimizer.state_dict(), want.optimizer.state_dict()
    assert got_opt["param_groups"] == want_opt["param_groups"]
    assert got_opt["state"].keys() == want_opt["state"].keys()
    for index, state in want_opt["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(got_opt["state"][index][key], value, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("autotune", [True, False])
def test_a_batched_update_equals_p_single_sac_updates(autotune: bool) -> None:
    """Three updates of three stacked agents with different learning rates, γ, τ, α and target
    entropies give each agent the weights, targets, temperature and Adam state that SAC's
    update gives it alone on the same batches and noise draws."""

    def make() -> list[SAC]:
        out = []
        for i, hp in enumerate(HPS):
            torch.manual_seed(i)
            out.append(
                SAC(*spaces(), SACConfig(hidden_sizes=[32, 32], autotune_alpha=autotune, **hp))
            )
        return out

    singles, stack = make(), SAC.Stack(make())
    replay, filled = replay_of(3, 100, 3, False, seed=0)
    kstep = KStep(stack, replay, filled, 64, seeds=[11, 12, 13])
    for _ in range(3):
        batch, (eps_next, eps) = drawn(kstep, 64, 2)
        stats = kstep.one(True, compiled=False)
        for i, agent in enumerate(singles):
            expected = reference_sac(agent, row(batch, i), eps_next[i], eps[i])
            for name, value in expected.items():
                assert float(stats[name][i]) == pytest.approx(float(value.detach()), rel=1e-4)
    for i, agent in enumerate(singles):
        out = make()[i]
        stack.get(i, out)
        assert_same_agent(out, agent)


@pytest.mark.parametrize("algorithm", ["td3", "ddpg"])
def test_a_batched_update_equals_p_single_td3_or_ddpg_updates(algorithm: str) -> None:
    """Four updates (two of them TD3's delayed actor updates) of three agents with different
    learning rates, γ, τ and target smoothing give each agent the weights, targets and Adam
    state (the actor's step count its own) that its update gives it alone."""
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

    singles, stack = make(), cls.Stack(make())
    replay, filled = replay_of(3, 100, 3, False, seed=1)
    kstep = KStep(stack, replay, filled, 64, seeds=[5, 6, 7])
    for k in range(1, 5):
        batch, (eps,) = drawn(kstep, 64, 1)
        stats = kstep.one(k % stack.policy_delay == 0, compiled=False)
        for i, agent in enumerate(singles):
            expected = reference_td3(agent, row(batch, i), eps[i], k)
            assert set(stats) == set(expected)
            for name, value in expected.items():
                assert float(stats[name][i]) == pytest.approx(float(value.detach()), rel=1e-4)
    for i, agent in enumerate(singles):
        out = make()[i]
        stack.get(i, out)
        assert_same_agent(out, agent)


@pytest.mark.parametrize(("double", "dueling"), [(False, False), (True, True)])
def test_a_batched_update_equals_p_single_dqn_updates(double: bool, dueling: bool) -> None:
    """Six updates of three DQN agents with different learning rates, γ, τ, target periods
    (soft every update, soft every 2nd, hard every 3rd) and gradient clipping (one clipped
    hard, one not at all), each on its own update count, give each agent the weights, targets
    and Adam state that DQN's update gives it alone; each agent's ε is ``DQN.epsilon``."""
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
            out.append(DQN(*spaces("CartPole-v1"), config))
        return out

    singles, stack = make(), DQN.Stack(make())
    replay, filled = replay_of(3, 100, 4, True, seed=2)
    kstep = KStep(stack, replay, filled, 64, seeds=[1, 2, 3])
    offsets = (5, 1, 0)
    for k in range(1, 7):
        batch, _ = drawn(kstep, 64, 0)
        # Each agent's own update count (a slot loaded from files goes on from theirs).
        stats = kstep(1, k, False, torch.tensor([k - 1 + o for o in offsets]))
        for i, agent in enumerate(singles):
            expected = reference_dqn(agent, row(batch, i), k + offsets[i])
            want = float(expected["loss"].detach())
            assert float(stats["loss"][i]) == pytest.approx(want, rel=1e-4)
    for i, agent in enumerate(singles):
        out = make()[i]
        stack.get(i, out)
        assert_same_agent(out, agent)
    # The targets moved differently: agent 2 (hard, every 3rd) holds its online weights of
    # its update 6, agent 1's (soft, every 2nd, last at its update 6 of 7) lag behind.
    online, target = stack.flats["q"], stack.flats["q_target"]
    torch.testing.assert_close(target[2], online[2])
    assert not torch.allclose(target[1], online[1])
    for steps in (0, 50, 5000):
        eps = stack.epsilon(torch.full((3,), steps))
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


def build(raw: list[dict[str, Any]]) -> OffPolicyTrainer:
    cls = trainer_class(raw[0]["algorithm"], len(raw))
    assert issubclass(cls, OffPolicyTrainer)
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
    assert isinstance(trainer, OffPolicyTrainer)

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
    parent_agent, parent_buffer = parent.single(0)  # type: ignore[attr-defined]
    want = parent_agent.state_dict()
    for i, member in enumerate(rt.slots):
        assert member.parent_id == outside_id and member.generation == 1
        copy = SAC(*spaces(), SACConfig(**trainer.config(i).sac.model_dump()))
        trainer.population.get(i, copy)
        for name, value in copy.state_dict().items():
            torch.testing.assert_close(value, want[name], msg=name)
        assert trainer.replay.size[i] == len(parent_buffer)
        assert float(trainer.population.adams["params"].steps[i]) == parent.updates
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


# -- the roles ------------------------------------------------------------------------------
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

    from services.pod.training.offpolicy import OffPolicyConfig

    raw = tiny("dqn", compile="on", updates_per_call=3)
    trainer = build(raw)
    try:
        assert trainer.learner.compiled
        with capture_logs() as logs:
            for _ in range(40):
                trainer.step()
        assert not [e for e in logs if e["event"] == "compile.failed"], logs
        assert trainer.updates > 0 and trainer.updates % 3 == 0
        assert torch.equal(trainer.learner.slot_updates, torch.full((2,), trainer.updates))
        trainer.save(1, tmp_path / "slot")
        config = OffPolicyConfig.model_validate({**raw[1], "compile": "off"})
        single = OffPolicyTrainer([config])
        try:
            single.load(0, tmp_path / "slot", config)
            slot, _ = trainer.single(1)
            loaded, _ = single.single(0)
            for name, value in slot.state_dict().items():
                torch.testing.assert_close(loaded.state_dict()[name], value, msg=name)
        finally:
            single.close()
    finally:
        trainer.close()
