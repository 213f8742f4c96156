"""The Anakin PPO iteration (services/pod/training/anakin.py): the same math as Podium's
CartPole env and PPO update, compiled equal to eager, PBT without recompiling, and learning
PureJaxRL's CartPole recipe."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from services.pod.algorithms import aot_program
from services.pod.algorithms.normalization import batch_stats
from services.pod.algorithms.ppo import PPO
from services.pod.algorithms.rollout import Rollout
from services.pod.envs.cartpole import CartPoleEnv
from services.pod.roles.evaluator import Evaluator
from services.pod.training import anakin
from services.pod.training.anakin import PUREJAXRL_CARTPOLE, AnakinPPO

# PureJaxRL's CartPole-v1 recipe (purejaxrl/ppo.py) in PPOConfig's names, with Podium's
# observation normalisation on (the Anakin loop normalises, as Podium's PPO does).
RECIPE = PUREJAXRL_CARTPOLE.model_copy(update={"compile": "off"})
SMALL = RECIPE.model_copy(update={"num_steps": 32, "update_epochs": 2})


def _close(a: torch.Tensor, b: torch.Tensor, **kw) -> None:
    torch.testing.assert_close(a, b, **kw)


def test_uniform_is_in_open_unit_interval_and_depends_on_every_input():
    seed = torch.tensor([0, 1, 2**40 + 7])
    u = anakin.uniform(seed, torch.tensor(0), 1, (1000,))
    assert u.shape == (3, 1000) and bool((u > 0).all()) and bool((u < 1).all())
    assert abs(float(u.mean()) - 0.5) < 0.03
    assert not torch.equal(u[0], u[1])
    assert not torch.equal(u, anakin.uniform(seed, torch.tensor(1), 1, (1000,)))
    assert not torch.equal(u, anakin.uniform(seed, torch.tensor(0), 2, (1000,)))
    assert torch.equal(u, anakin.uniform(seed, torch.tensor(0), 1, (1000,)))


def test_functional_cartpole_step_equals_the_env():
    env = CartPoleEnv(num_envs=64, seed=3, check_actions=False)
    env.reset()
    gen = torch.Generator().manual_seed(0)
    state = env.state.clone()
    for _ in range(200):
        actions = torch.randint(0, 2, (64,), generator=gen)
        new, reward, terminated = anakin.cartpole_step(state, actions)
        reward_env, terminated_env = env._physics_step(actions)
        assert torch.equal(new, env.state)
        assert torch.equal(reward, reward_env) and torch.equal(terminated, terminated_env)
        env.state.copy_(torch.where(terminated.unsqueeze(1), env._initial_state(64), env.state))
        state = env.state.clone()


class _HostCopies(TorchDispatchMode):
    """Records each copy out of host memory: what a CUDA graph cannot capture."""

    _COPIES = frozenset({"_to_copy", "copy_", "lift_fresh", "lift_fresh_copy"})

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in self._COPIES and any(
            isinstance(a, torch.Tensor) and a.device.type == "cpu"
            for a in tree_flatten((args, kwargs))[0]
        ):
            self.copies.append(str(func))
        return func(*args, **kwargs)


def test_an_iteration_copies_nothing_from_the_host():
    # The iteration on the meta device: any tensor it makes on the host and moves over (the
    # functional CartPole's constants did) would be a host-to-device copy inside the CUDA
    # graph's capture, which CUDA refuses.
    shape, state, hp = anakin.build(
        SMALL.model_copy(update={"num_steps": 8}), [0, 1], device="meta"
    )
    with _HostCopies() as mode:
        anakin.ppo_iteration(shape, state, hp)
    assert mode.copies == []


def test_the_programs_take_the_weights_and_adam_moments_as_one_tensor_each():
    """Each tensor a compiled program takes or returns costs host time on every call, and
    the update is called epochs x minibatches times an iteration: the programs see the
    agents' weights, Adam's moments and their outputs as a few flat tensors, however many
    layers the networks have (one tensor per layer was 3 x 12 inputs and outputs)."""
    deep = SMALL.model_copy(update={"hidden_sizes": [16, 16, 16, 16]})
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, inputs: list) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    run = AnakinPPO(deep, [0, 1])
    params, width = run.state["params"], run.shape.layout.size
    assert params.shape == (2, width) and run.state["exp_avg"].shape == (2, width)
    shape, state, hp = run.shape, run.state, run.hp
    roll = anakin.collect(shape, state)
    b = anakin.batch(shape, state, roll, hp)
    data = tuple(b[k] for k in ("obs", "actions", "logprobs", "advantages", "returns", "values"))
    opt = {k: state[k] for k in ("params", "exp_avg", "exp_avg_sq", "adam_step")}
    idx = b["orders"][:, 0, : shape.minibatch]
    update = torch.compile(anakin.minibatch_update, backend=record, fullgraph=True, dynamic=False)
    new, _ = update(shape, opt, data, idx, hp, hp["learning_rate"])
    chunk = torch.compile(anakin.rollout_chunk, backend=record, fullgraph=True, dynamic=False)
    norm = {k: state[k] for k in ("obs_mean", "obs_var")}
    carry = (state["env"], state["ep_return"], state["ep_length"])
    chunk(shape, params, norm, carry, (state["seed"], state["iteration"], torch.tensor(2)), 2)
    torch._dynamo.reset()
    update_graph, chunk_graph = graphs
    placeholders = [n for n in update_graph.graph.nodes if n.op == "placeholder"]
    # params, exp_avg, exp_avg_sq, adam_step, six data tensors, idx, four hyperparameters, lr
    assert len(placeholders) <= 16
    assert len(tree_flatten(new)[0]) == 4  # params, exp_avg, exp_avg_sq, adam_step
    assert new["params"].shape == params.shape
    # the weights, two statistics, the carry (3) and the noise's counter (3)
    assert len([n for n in chunk_graph.graph.nodes if n.op == "placeholder"]) <= 9


def test_cuda_graph_needs_a_cuda_device():
    with pytest.raises(ValueError, match="cuda_graph: needs a CUDA device"):
        AnakinPPO(SMALL, [0], cuda_graph=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replays_the_iteration_and_sees_new_hyperparameters():
    plain = AnakinPPO(SMALL, range(4), total_env_steps=10**6, device="cuda")
    graphed = AnakinPPO(SMALL, range(4), total_env_steps=10**6, device="cuda", cuda_graph=True)
    for _ in range(3):
        plain.step()
        graphed.step()
    assert torch.equal(plain.state["params"], graphed.state["params"])
    assert torch.equal(plain.state["env"], graphed.state["env"])
    before = graphed.state["params"].clone()
    graphed.set_hyperparameters(0, {"learning_rate": 0.0})  # a PBT explore, after capture
    graphed.step()
    params = graphed.state["params"]
    assert torch.equal(before[0], params[0])
    assert not torch.equal(before[1], params[1])
    assert int(graphed.state["iteration"]) == 4


@pytest.mark.parametrize("max_episode_steps", [3, 7, 500])
def test_values_of_only_the_truncated_final_observations_give_the_same_advantages(
    monkeypatch, max_episode_steps
):
    """The critic runs on ceil(T / max_episode_steps) final observations per env: the
    advantages equal those from V of every final observation, truncations at every step
    count (3: most episodes end by truncation) included."""
    run = AnakinPPO(SMALL, [4, 6], max_episode_steps=max_episode_steps)
    run.step()  # episodes in flight, some near their step limit
    roll = anakin.collect(run.shape, run.state)
    if max_episode_steps < SMALL.num_steps:
        assert roll["truncated"].any(0).all()  # every env truncated in this rollout
    got = anakin.advantages(run.shape, run.state["params"], roll, run.hp)

    def every(shape, value, final_obs, truncated):
        t_, p, n, d = shape.num_steps, shape.agents, shape.num_envs, shape.obs_dim
        return value(final_obs.transpose(0, 1).reshape(p, t_ * n, d)).view(p, t_, n)

    monkeypatch.setattr(anakin, "truncated_values", every)
    want = anakin.advantages(run.shape, run.state["params"], roll, run.hp)
    for a, b in zip(got, want, strict=True):
        _close(a, b)


def test_gae_as_one_weighted_sum_equals_the_recursion():
    gen = torch.Generator().manual_seed(0)
    p, t_, n = 3, 64, 5
    delta = torch.randn(p, t_, n, generator=gen, dtype=torch.float64)
    not_done = (torch.rand(p, t_, n, generator=gen) > 0.1).double()
    not_done[0, :, 0] = 0.0  # every step ends an episode
    not_done[1, :, 1] = 1.0  # no step does
    gamma_lambda = torch.tensor([0.9405, 0.5, 0.999], dtype=torch.float64)
    last, trace = torch.zeros(p, n, dtype=torch.float64), []
    for t in reversed(range(t_)):
        last = delta[:, t] + gamma_lambda.view(p, 1) * not_done[:, t] * last
        trace.append(last)
    expected = torch.stack(trace[::-1], 1)
    _close(anakin._gae_matrix(delta, not_done, gamma_lambda), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_failed_capture_runs_on_without_the_graph(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "graph", refuse)
    run = AnakinPPO(SMALL, [0, 1], total_env_steps=10**6, device="cuda", cuda_graph=True)
    run.step()
    run.step()
    assert run.cuda_graph is False and run.iterations == 2
    assert int(run.state["iteration"]) == 2


def test_rejects_an_env_without_a_functional_step():
    from services.pod.envs.pendulum import PendulumEnv

    with pytest.raises(ValueError, match="env: no functional step for PendulumEnv"):
        anakin.build(SMALL, [0], env=PendulumEnv)


def test_rejects_unknown_hyperparameters():
    with pytest.raises(ValueError, match=r"hyperparameters: unknown \['lr'\]"):
        anakin.build(SMALL, [0], [{"lr": 1e-3}])
    run = AnakinPPO(SMALL, [0])
    with pytest.raises(ValueError, match="hyperparameters: unknown 'num_envs'"):
        run.set_hyperparameters(0, {"num_envs": 8})


def test_eager_iteration_equals_env_steps_and_podiums_ppo_update(monkeypatch):
    """Two iterations of two agents: the rollout is what CartPoleEnv.step_masked gives for
    the same actions and reset states, the actions are CategoricalActor.sample's for the same
    noise, and the update is PPO.update on that rollout with the same shuffles (torch.randperm
    replaced by the iteration's permutations), learning-rate annealing included."""
    seeds = [5, 9]
    run = AnakinPPO(SMALL, seeds, total_env_steps=10 * SMALL.batch_size)
    shape = run.shape
    agents = []
    for seed in seeds:
        torch.manual_seed(seed)
        agents.append(PPO(*_spaces(), SMALL))
    envs = [CartPoleEnv(num_envs=shape.num_envs, check_actions=False) for _ in seeds]
    for i, env in enumerate(envs):
        env.state.copy_(run.state["env"][i])
    for iteration in range(2):
        before = run.state
        roll = anakin.collect(shape, before)
        action_u, reset_u = anakin.noise(
            shape, before["seed"], before["iteration"], 0, shape.num_steps
        )
        perms = anakin.shuffles(shape, before)
        run.state, metrics = anakin.learn(shape, before, roll, run.hp)
        for i, (agent, env) in enumerate(zip(agents, envs, strict=True)):
            for t in range(shape.num_steps):
                _close(roll["raw"][t, i], env.state.to(torch.float32))
                norm = agent.policy.normalize(roll["raw"][t, i])
                _close(roll["obs"][t, i], norm)
                action, logp = agent.policy.actor.sample(norm, noise=action_u[t, i])
                assert torch.equal(action, roll["actions"][t, i])
                _close(logp, roll["logprobs"][t, i])
                fresh = anakin.cartpole_initial(reset_u[t, i])
                _, reward, term, trunc, info = env.step_masked(action, fresh)
                assert torch.equal(term, roll["terminated"][t, i])
                assert torch.equal(trunc, roll["truncated"][t, i])
                _close(reward, roll["rewards"][t, i])
                _close(agent.policy.normalize(info["final_obs"]), roll["final_obs"][t, i])
            rollout = Rollout(
                obs=roll["obs"][:, i],
                actions=roll["actions"][:, i],
                logprobs=roll["logprobs"][:, i],
                rewards=roll["rewards"][:, i],
                terminated=roll["terminated"][:, i],
                truncated=roll["truncated"][:, i],
                final_obs=roll["final_obs"][:, i],
                next_obs=roll["next_obs"][i],
                obs_stats=batch_stats(roll["raw"][:, i], (shape.obs_dim,)),
                return_stats=batch_stats(roll["rewards"][:, i].double()),
                episode_returns=torch.zeros(0),
                episode_lengths=torch.zeros(0, dtype=torch.int64),
            )
            orders = iter(perms[i])
            monkeypatch.setattr(torch, "randperm", lambda n, device=None, o=orders: next(o))
            stats = agent.update(rollout, lr_fraction=1.0 - iteration / 10)
            monkeypatch.undo()
            params = run.shape.views(run.state["params"])
            for name, tensor in agent.policy.actor.named_parameters(prefix="actor"):
                _close(params[name][i], tensor, atol=1e-5, rtol=1e-4)
            for name, tensor in agent.critic.named_parameters(prefix="critic"):
                _close(params[name][i], tensor, atol=1e-5, rtol=1e-4)
            rms = agent.policy.obs_rms
            _close(run.state["obs_mean"][i], rms.mean)
            _close(run.state["obs_var"][i], rms.var)
            _close(float(metrics["lr"][i]), stats["lr"])
            _close(metrics["stats"][i, 1].item(), stats["v_loss"], rtol=1e-4, atol=1e-5)


def _spaces():
    env = CartPoleEnv(num_envs=1)
    return env.single_observation_space, env.single_action_space


# The whole iteration as one program compiles for minutes even at a few steps on this
# project's CPU (docs/benchmarks.md, "Anakin iteration"), so its check is nightly and small.
TINY = SMALL.model_copy(update={"num_steps": 4, "update_epochs": 1, "num_minibatches": 2})


@pytest.mark.parametrize(
    ("mode", "config"),
    [
        pytest.param("steps", SMALL, marks=pytest.mark.slow),
        pytest.param("iteration", TINY, marks=[pytest.mark.slow, pytest.mark.nightly]),
    ],
)
def test_compiled_equals_eager_and_pbt_does_not_recompile(mode, config):
    from torch._dynamo.utils import counters

    steps = 10 * config.batch_size
    eager = AnakinPPO(config, [1, 2], total_env_steps=steps)
    compiled = AnakinPPO(config, [1, 2], total_env_steps=steps, compile=mode)
    for _ in range(2):
        eager.step()
        compiled.step()
    for key in ("env", "ep_length", "obs_mean", "obs_var", "adam_step"):
        _close(compiled.state[key], eager.state[key], atol=1e-5, rtol=1e-4)
    _close(compiled.state["params"], eager.state["params"], atol=1e-5, rtol=1e-4)

    graphs, programs = counters["stats"]["unique_graphs"], dict(aot_program.COUNTS)
    # PBT: explore changes agent 0's values, exploit starts a child with new seeds and
    # hyperparameters; both run the graphs already compiled.
    compiled.set_hyperparameters(0, {"learning_rate": 1e-3, "ent_coef": 0.0, "gamma": 0.95})
    compiled.step()
    child = AnakinPPO(
        config,
        [7, 8],
        [{"clip_coef": 0.1}, {"vf_coef": 1.0}],
        total_env_steps=2 * steps,
        compile=mode,
    )
    child.step()
    assert counters["stats"]["unique_graphs"] == graphs
    assert dict(aot_program.COUNTS) == programs  # nothing built, nothing loaded again
    assert float(compiled.hp["learning_rate"][0]) == pytest.approx(1e-3)

    # From the third iteration on the programs run without dynamo's guards: they must still
    # read the new hyperparameters, and a runner of another shape sharing the programs must
    # neither break this one nor be broken.
    assert compiled._skip_guards
    eager.set_hyperparameters(0, {"learning_rate": 1e-3, "ent_coef": 0.0, "gamma": 0.95})
    eager.step()
    wider = AnakinPPO(
        config.model_copy(update={"num_envs": 2 * config.num_envs}), [3], compile=mode
    )
    for _ in range(3):
        wider.step()
    eager.step()
    compiled.step()
    _close(compiled.state["params"], eager.state["params"], atol=1e-5, rtol=1e-4)
    alone = AnakinPPO(wider.config, [3])
    for _ in range(3):
        alone.step()
    _close(wider.state["params"], alone.state["params"], atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_learns_purejaxrls_cartpole_recipe():
    """P = 4 agents, at most 5e5 env steps each: at least 3 of 4 reach a greedy evaluation
    return >= 475 (10 episodes), evaluated every 40 iterations (20,480 env steps) and at
    the end, as Podium's time-to-target checks count a solve."""
    steps = 500_000
    run = AnakinPPO(RECIPE, [0, 1, 2, 3], total_env_steps=steps, compile="steps")
    best = [0.0] * run.shape.agents
    while run.env_steps < steps and sum(b >= 475 for b in best) < 3:
        run.step()
        if run.iterations % 40 == 0 or run.env_steps >= steps:
            for i in range(run.shape.agents):
                env = CartPoleEnv(num_envs=10, seed=100 + i)
                score = Evaluator(env, seed=100 + i).evaluate(run.agent(i).policy).mean
                best[i] = max(best[i], score)
    assert sum(b >= 475 for b in best) >= 3, best
