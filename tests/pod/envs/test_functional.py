"""Functional envs (services/pod/envs/functional.py): each env's physics is defined once, as pure
functions; the vector env users know is a thin wrapper that steps the same functions, and
``vector_step`` (what the compiled loops run) gives what the vector env gives; compiled, the
same numbers; every env's card (services/contracts/envs.py) says what it is."""

from __future__ import annotations

import pytest
import torch

from services import registry
from services.contracts.envs import env_card
from services.pod.envs.base import TorchVecEnv
from services.pod.envs.functional import vector_step
from services.pod.envs.registry import _accepted, functional_env, is_functional, make_env
from services.pod.roles.worker import HostStep

FUNCTIONAL = {
    "CartPole-v1": {},
    "Acrobot-v1": {},
    "Pendulum-v1": {},
    "MountainCarContinuous-v0": {},
    "StockTrading-v0": {"num_stocks": 3, "score": "sharpe"},
}
#: The registered envs that need simulators this machine may lack (their cards still load).
GPU_ONLY = ("MjWarp-", "Isaac-")


def actions(env: TorchVecEnv, g: torch.Generator) -> torch.Tensor:
    space = env.single_action_space
    if hasattr(space, "n"):
        return torch.randint(0, int(space.n), (env.num_envs,), generator=g)
    return torch.rand(env.num_envs, *space.shape, generator=g) * 2.4 - 1.2  # some beyond bounds


def test_every_registered_env_has_a_card_that_says_what_it_is() -> None:
    for name in registry.names(registry.ENVS):
        card = env_card(name)
        assert card is not None and card.name == name, name
        if name.startswith(GPU_ONLY):
            assert not card.functional
            continue
        env = make_env(name, 1, seed=0)
        kind = "discrete" if hasattr(env.single_action_space, "n") else "continuous"
        assert card.action_kind == kind, name
        assert card.functional == is_functional(name) == isinstance(env, TorchVecEnv), name
        env.close()
    assert env_card("gym:HalfCheetah-v5").target_return == 3000.0  # type: ignore[union-attr]
    assert env_card("envpool:Hopper-v4").functional is False  # type: ignore[union-attr]
    assert env_card("CartPole-v1").target_return == 475.0  # type: ignore[union-attr]
    assert env_card("Nope-v0") is None


def test_a_card_s_arguments_are_its_env_s() -> None:
    """What a spec's env.kwargs may give (checked at submission, torch-free) is what the env's
    factory takes, less what the pod sets itself: the card cannot drift from the env."""
    checked = 0
    for name in registry.names(registry.ENVS):
        card = env_card(name)
        assert card is not None
        accepted = _accepted(registry.load(registry.ENVS, name, kind="env"))
        if card.kwargs is None:
            continue
        assert accepted is not None, name
        assert card.kwargs == accepted - {"num_envs", "device", "seed"}, name
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("name", list(FUNCTIONAL))
def test_vector_step_is_what_the_vector_env_does(name: str) -> None:
    """The same states, actions and reset draws: ``vector_step`` over explicit state gives the
    vector env's observations, rewards, endings, final observations, episode returns and
    scores, through terminations, time limits and same-step autoresets."""
    kwargs = FUNCTIONAL[name]
    limit = {"episode_length": 7} if name == "StockTrading-v0" else {"max_episode_steps": 7}
    env = make_env(name, 16, seed=3, **limit, **kwargs)
    assert isinstance(env, TorchVecEnv)
    fn = env.fn
    env.reset()
    carry = fn.start(torch.zeros(16, fn.reset_uniforms, dtype=fn.dtype))
    carry = carry._replace(state=env.state.clone())
    g = torch.Generator().manual_seed(0)
    ends = 0
    for _ in range(20):
        action = actions(env, g)
        # The vector env's resets draw from its generator: the same uniforms, given here.
        state = env.generator.get_state()
        u = torch.rand((fn.reset_uniforms, 16), generator=env.generator, dtype=fn.dtype).T
        env.generator.set_state(state)
        env._host_reads_free = False  # resets every env's row by mask, as an accelerator does
        got_obs, reward, term, trunc, info = env.step(action)
        carry, out = vector_step(fn, carry, action, u)
        torch.testing.assert_close(out.obs, got_obs)
        torch.testing.assert_close(out.reward, reward)
        assert torch.equal(out.terminated, term) and torch.equal(out.truncated, trunc)
        torch.testing.assert_close(out.final_obs, info["final_obs"])
        torch.testing.assert_close(out.episode_return, info["episode_return"])
        score = info.get("episode_score", info["episode_return"])
        torch.testing.assert_close(out.episode_score, score.to(out.episode_score.dtype))
        torch.testing.assert_close(carry.state, env.state)
        ends += int((term | trunc).sum())
    assert ends > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FUNCTIONAL))
def test_the_compiled_step_gives_the_eager_numbers(name: str) -> None:
    fn = functional_env(name, **FUNCTIONAL[name])
    assert fn is not None
    g = torch.Generator().manual_seed(1)
    carry = fn.start(torch.rand(2, 8, fn.reset_uniforms, generator=g, dtype=fn.dtype))
    step = torch.compile(vector_step, fullgraph=True)
    eager, compiled = carry, carry
    probe = make_env(name, 16, **FUNCTIONAL[name])
    for _ in range(12):
        action = actions(probe, g).view(2, 8, *probe.single_action_space.shape)
        u = torch.rand(2, 8, fn.reset_uniforms, generator=g, dtype=fn.dtype)
        eager, want = vector_step(fn, eager, action, u)
        compiled, got = step(fn, compiled, action, u)
        for a, b in zip((*got, *compiled), (*want, *eager), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_an_env_that_overrides_its_step_is_stepped_on_the_host(tmp_path, monkeypatch) -> None:
    """A plugin's subclass of a torch-native env with a step of its own is not its functional
    env: it trains on the host (its own step runs), and says so."""
    from services.pod.config import PPORunConfig
    from services.pod.training.onpolicy import OnPolicyTrainer
    from tests.pod.plugins import register_plugin

    source = (
        "from services.pod.envs.cartpole import CartPoleEnv\n"
        "class Counting(CartPoleEnv):\n"
        "    steps = 0\n"
        "    def step(self, action):\n"
        "        Counting.steps += 1\n"
        "        return super().step(action)\n"
    )
    envs = {"Counting-v0": "podium_counting:Counting"}
    register_plugin(tmp_path, monkeypatch, "podium_counting", source, {"podium.envs": envs})
    assert not is_functional("Counting-v0") and is_functional("CartPole-v1")
    config = PPORunConfig.model_validate(
        {"env": "Counting-v0", "eval_episodes": 2, "ppo": {"num_envs": 4, "num_steps": 8}}
    )
    trainer = OnPolicyTrainer([config])
    assert isinstance(trainer.population.host, HostStep)
    trainer.step()
    import podium_counting  # type: ignore[import-not-found]

    assert podium_counting.Counting.steps == 8
    trainer.close()
