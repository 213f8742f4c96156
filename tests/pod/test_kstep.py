"""The K-step update of off-policy stacks (services/pod/algorithms/stacked.py ``KStep``): K
updates per call run each algorithm's one update (itself checked against single agents in
test_offpolicy_population.py), compiled or eager, with the same numbers; DQN's targets move on
each agent's own update count; changing a hyperparameter or rebuilding the agents compiles
nothing new; a compile that fails trains on eager under ``auto`` and is refused under ``on``.

Compiling one update costs a minute on a loaded 2-core CPU, so the tests that compile are
``slow``; they share one process's dynamo cache and the session's inductor cache.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from services.pod.algorithms.compiled import (
    CompileRefusedError,
    Program,
    cached,
)
from services.pod.algorithms.counter_random import box_muller, draws, stream_bits, uniform
from services.pod.algorithms.ddpg import DDPG, DDPGConfig
from services.pod.algorithms.dqn import DQN, DQNConfig
from services.pod.algorithms.sac import SAC, SACConfig, SACStack, sac_update
from services.pod.algorithms.stacked import BATCH_STREAM, KStep, Stack, draw_batch
from services.pod.algorithms.td3 import TD3, TD3Config
from services.pod.envs.registry import make_env
from services.pod.training.offpolicy import OffPolicyConfig, OffPolicyTrainer
from tests.pod.harness import compile_counters
from tests.pod.test_offpolicy import assert_solves

SAC_HPS = [
    {"learning_rate": 1e-3, "gamma": 0.99, "tau": 0.005, "init_alpha": 1.0},
    {"learning_rate": 3e-3, "gamma": 0.95, "tau": 0.02, "init_alpha": 0.5},
    {"learning_rate": 5e-4, "gamma": 0.9, "tau": 0.1, "init_alpha": 0.2, "target_entropy": -2.0},
]
TD3_HPS = [
    {"learning_rate": 1e-3, "gamma": 0.99, "tau": 0.005, "policy_noise": 0.2},
    {"learning_rate": 3e-3, "gamma": 0.95, "tau": 0.02, "policy_noise": 0.5, "noise_clip": 0.3},
    {"learning_rate": 5e-4, "gamma": 0.9, "tau": 0.1, "policy_noise": 0.1},
]
#: Soft every update, soft every 2nd and clipped hard, a hard copy every 3rd and not clipped.
DQN_HPS = [
    {"learning_rate": 1e-3, "gamma": 0.99, "tau": 0.05, "target_update_every": 1},
    {"learning_rate": 3e-3, "gamma": 0.95, "tau": 0.2, "target_update_every": 2,
     "max_grad_norm": 0.05},
    {"learning_rate": 5e-4, "gamma": 0.9, "tau": 1.0, "target_update_every": 3,
     "max_grad_norm": None},
]  # fmt: skip
BATCH, CAPACITY = 16, 40
#: DQN agents' own update counts before a call (a slot loaded from files goes on from its).
DQN_FIRST = torch.tensor([1, 4, 2])


def _agents(algorithm: str, p: int, hidden: int = 16, device: str = "cpu") -> list:
    env = make_env("CartPole-v1" if algorithm == "dqn" else "Pendulum-v1", 1)
    spaces = env.single_observation_space, env.single_action_space
    env.close()
    out = []
    for i in range(p):
        torch.manual_seed(i)
        if algorithm == "dqn":
            config = DQNConfig(hidden_sizes=[hidden], double=True, dueling=True)
            agent = DQN(*spaces, config.model_copy(update=DQN_HPS[i]))
        elif algorithm == "sac":
            agent = SAC(*spaces, SACConfig(hidden_sizes=[hidden], **SAC_HPS[i]))
        elif algorithm == "td3":
            agent = TD3(*spaces, TD3Config(hidden_sizes=[hidden], **TD3_HPS[i]))
        else:
            hp = {k: v for k, v in TD3_HPS[i].items() if k in ("learning_rate", "gamma", "tau")}
            agent = DDPG(*spaces, DDPGConfig(hidden_sizes=[hidden], **hp))
        out.append(agent.to(device))
    return out


def _stack(algorithm: str, p: int, device: str = "cpu") -> Stack:
    agents = _agents(algorithm, p, device=device)
    return type(agents[0]).Stack(agents)


def _replay(
    p: int, seed: int = 0, device: str = "cpu", algorithm: str = "sac"
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Random transitions: Pendulum's shapes, or CartPole's with two discrete actions."""
    g = torch.Generator().manual_seed(seed)
    obs = 4 if algorithm == "dqn" else 3
    action = (
        torch.randint(0, 2, (p, CAPACITY), generator=g)
        if algorithm == "dqn"
        else torch.rand(p, CAPACITY, 1, generator=g) * 2 - 1
    )
    fields = (
        torch.randn(p, CAPACITY, obs, generator=g),
        action,
        torch.randn(p, CAPACITY, generator=g),
        torch.randn(p, CAPACITY, obs, generator=g),
        (torch.rand(p, CAPACITY, generator=g) < 0.2).float(),
    )
    # Each agent its own fill level: indices must come from its filled rows only.
    filled = torch.tensor([CAPACITY, 25, 7][:p], dtype=torch.int64)
    return tuple(f.to(device) for f in fields), filled.to(device)


def _assert_same_state(a: Stack, b: Stack) -> None:
    for name, x in a.state().items():
        torch.testing.assert_close(x, b.state()[name], rtol=1e-4, atol=1e-5, msg=name)


def test_counter_based_draws_are_uniform_reproducible_and_within_the_filled_rows() -> None:
    """An agent's draws depend only on its seed and the counter (not on the other agents'),
    lie in (0, 1) and pick only its filled rows."""
    seeds, counter = torch.tensor([5, 6, 7]), torch.tensor(3)
    u = uniform(seeds, counter, 0, (10_000,))
    assert u.shape == (3, 10_000) and bool((u > 0).all() and (u < 1).all())
    assert abs(float(u.mean()) - 0.5) < 0.01
    torch.testing.assert_close(uniform(seeds[1:2], counter, 0, (10_000,))[0], u[1])
    assert not torch.equal(uniform(seeds, counter + 1, 0, (10_000,)), u)
    fields, filled = _replay(3)
    batch = draw_batch(fields, filled, uniform(seeds, counter, BATCH_STREAM, (500,)))
    obs = fields[0]
    for i, rows in enumerate(filled.tolist()):
        # Every drawn observation is one of the agent's filled rows, and all of them show up.
        found = (batch.obs[i].unsqueeze(1) == obs[i].unsqueeze(0)).all(-1)
        assert bool(found[:, :rows].any(1).all()) and not bool(found[:, rows:].any())
        assert int(found[:, :rows].any(0).sum()) == rows


def _reference_bits(seed: int, counter: int, stream: int, index: int) -> int:
    """counter_random's hash in Python integers, written from its definition."""

    def mix(x: int) -> int:
        x = ((x ^ (x >> 16)) * 0x7FEB352D) & 0xFFFFFFFF
        x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
        return x ^ (x >> 16)

    key = mix(seed & 0xFFFFFFFF)
    key = mix((key + mix((counter & 0xFFFFFFFF) ^ (stream * 0x2545F491))) & 0xFFFFFFFF)
    return mix(mix((key + index) & 0xFFFFFFFF) ^ key)


def test_one_pass_over_several_streams_draws_what_each_stream_draws_alone() -> None:
    """An update draws its minibatch and its noise in one ``draws`` call (one pass of ops for
    every stream): the values are each stream's own, as the hash defines them."""
    seeds, counter = torch.tensor([5, 2**33 + 6, 7]), torch.tensor([3, 4, 2**40])
    u, n = draws(seeds, counter, {BATCH_STREAM: (9,)}, {1: (9, 2), 2: (9, 2)})
    assert torch.equal(u[BATCH_STREAM], uniform(seeds, counter, BATCH_STREAM, (9,)))
    for s in (1, 2):  # a normal of stream s: Box-Muller of the uniforms of 2s and 2s + 1
        alone = [uniform(seeds, counter, u, (9, 2)) for u in (2 * s, 2 * s + 1)]
        assert n[s].shape == (3, 9, 2) and torch.equal(n[s], box_muller(*alone))
    bits = stream_bits(seeds, counter, (4, 0), 6, offset=5)
    assert bits.shape == (3, 2, 6)
    for agent, (stream, column) in itertools.product(range(3), ((4, 0), (0, 1))):
        seed, count = int(seeds[agent]), int(counter[agent])
        expected = [_reference_bits(seed, count, stream, 5 + k) for k in range(6)]
        assert bits[agent, column].tolist() == expected
    with pytest.raises(ValueError, match="stream 2 drawn twice"):
        draws(seeds, counter, {2: (3,)}, {1: (4,)})


@pytest.mark.parametrize(("double", "dueling"), [(False, False), (True, True)])
def test_eager_dqn_k_step_moves_each_agents_targets_on_its_own_update_count(
    double: bool, dueling: bool
) -> None:
    """Agent i's targets move where its own update number (its count before the call, plus
    one per update) is a multiple of its period: agent 2 (hard copy every 3rd) holds its
    online weights exactly after its update 3, and not after its update 4."""
    agents = _agents("dqn", 3)
    for agent in agents:
        agent.config = agent.config.model_copy(update={"double": double, "dueling": dueling})
    fields, filled = _replay(3, algorithm="dqn")
    stack = DQN.Stack(agents)
    run = KStep(stack, fields, filled, BATCH, seeds=[5, 6, 7])
    run(1, 1, False, DQN_FIRST)  # agent 2's update 3
    torch.testing.assert_close(stack.flats["q_target"][2], stack.flats["q"][2])
    run(1, 2, False, DQN_FIRST + 1)  # its update 4: not a multiple of 3
    assert not torch.allclose(stack.flats["q_target"][2], stack.flats["q"][2])


def _config(compile: str, algorithm: str = "sac", **loop: Any) -> OffPolicyConfig:
    return OffPolicyConfig.model_validate(
        {
            "env": "Pendulum-v1",
            "algorithm": algorithm,
            "seed": 4,
            "num_envs": 4,
            "learning_starts": 32,
            "batch_size": BATCH,
            "buffer_size": CAPACITY,
            "updates_per_step": 0.5,
            "compile": compile,
            "updates_per_call": 2,
            "total_env_steps": 1_000,
            algorithm: {"hidden_sizes": [16]},
            **loop,
        }
    )


def test_on_without_a_cxx_compiler_is_refused_and_auto_trains_eager_saying_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "g++"))
    with pytest.raises(CompileRefusedError, match="no C\\+\\+ compiler"):
        OffPolicyTrainer([_config("on")])
    trainer = OffPolicyTrainer([_config("auto")])
    try:
        assert trainer.decision.compiled is False
        assert trainer.compiled.startswith("eager (auto: no C++ compiler")
    finally:
        trainer.close()


def test_an_update_dynamo_cannot_capture_trains_eager_under_auto_and_is_refused_under_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """A compile that fails (here: an update that reads the host, which ``fullgraph`` refuses)
    is logged once under ``auto`` and the run trains on with the same update, eager, every
    owed update paid, and notes nothing in the compile cache; under ``on`` it is refused,
    naming it."""

    def host_reading(*args: Any) -> dict[str, torch.Tensor]:
        if float(args[7]["params"].abs().sum()) < 0:  # never, but read on the host
            raise AssertionError
        return sac_update(*args)

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(SACStack, "update", Program(host_reading, "sac_update"))
    trainer = OffPolicyTrainer([_config("auto")])
    trainer.decision.compiled = True  # as auto decides where compiling pays
    trainer.learner.compile(True, 2)
    try:
        before = trainer.population.flats["params"].clone()
        with capture_logs() as logs:
            for _ in range(12):
                trainer.step()
        failed = [e for e in logs if e["event"] == "compile.failed"]
        assert len(failed) == 1 and failed[0]["fallback"] == "eager"
        assert trainer.learner.updates == 10  # (48 - 32 + 4) env steps x 0.5, all paid
        assert trainer.compiled.startswith("eager (auto: compiling failed")
        assert not torch.equal(before, trainer.population.flats["params"])
        assert not cached(trainer.configs[0], trainer.program_key(), ["update"])
    finally:
        trainer.close()
    trainer = OffPolicyTrainer([_config("on")])
    try:
        with pytest.raises(CompileRefusedError, match="cannot be honoured.*sac_update"):
            for _ in range(12):
                trainer.step()
    finally:
        trainer.close()


# -- compiled ---------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    ("algorithm", "p"),
    [
        # One agent is the population's P = 1 (the same functions): nightly, beside P = 3.
        pytest.param("sac", 1, marks=pytest.mark.nightly),
        ("sac", 3),
        ("td3", 3),
        # TD3's update without target smoothing: nightly, its compile is TD3's again.
        pytest.param("ddpg", 2, marks=pytest.mark.nightly),
        ("dqn", 3),
    ],
)
def test_compiled_k_step_equals_eager_k_step(algorithm: str, p: int) -> None:
    fields, filled = _replay(p, algorithm=algorithm)
    compiled, eager = _stack(algorithm, p), _stack(algorithm, p)
    slot_updates = DQN_FIRST[:p] - 1 if algorithm == "dqn" else None
    with capture_logs() as logs:
        got = KStep(compiled, fields, filled, BATCH, seeds=[5, 6, 7][:p])(4, 1, True, slot_updates)
    assert not [e for e in logs if e["event"] == "compile.failed"], logs
    want = KStep(eager, fields, filled, BATCH, seeds=[5, 6, 7][:p])(4, 1, False, slot_updates)
    _assert_same_state(compiled, eager)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5, msg=name)


def _explore(stack: Stack) -> None:
    """PBT's explore on every hyperparameter tensor (DQN's target periods: one longer)."""
    for value in stack.hp.values():
        if value.is_floating_point():
            value.mul_(0.5)
        else:
            value.add_(1)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["sac", "td3", "dqn"])
def test_new_hyperparameters_or_agents_compile_nothing_new(algorithm: str) -> None:
    """PBT's explore (new learning rates, γ, τ, noise, DQN's target periods and clips in the
    (P,) tensors) and exploit (the agents rebuilt from other weights) reuse the compiled
    update."""
    fields, filled = _replay(3, algorithm=algorithm)
    stack = _stack(algorithm, 3)
    run = KStep(stack, fields, filled, BATCH, seeds=[5, 6, 7])
    run(2, 1, True)  # compiles (TD3: the critics' update and the delayed one)
    before = compile_counters()
    _explore(stack)
    stats = run(2, 3, True, DQN_FIRST - 1)
    rebuilt = _stack(algorithm, 3)
    KStep(rebuilt, fields, filled, BATCH, seeds=[8, 9, 10])(2, 1, True)
    assert compile_counters() == before
    assert all(bool(torch.isfinite(v).all()) for v in stats.values())


def test_auto_counts_a_load_only_when_every_update_program_ran_compiled(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """TD3 builds two programs, its delayed update (actor and targets too) and the critics'
    own: a run whose compiled calls ran only one of them leaves the other to compile, so the
    next trainer of that shape counts a cold compile, not a load; once both ran, a load."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    trainer = OffPolicyTrainer([_config("off", "td3")])
    try:
        assert " at 0x" not in trainer.program_key()  # the same in every process
        other = OffPolicyTrainer([_config("on", "td3")])
        other.close()
        assert trainer.program_key() == other.program_key()
        trainer.learner.kstep.compiled_kinds.add(True)  # as after a call of the delayed update
        trainer.step()
        assert not _cached(_config("auto", "td3"))
        trainer.learner.kstep.compiled_kinds.add(False)
        trainer.step()
        assert _cached(_config("auto", "td3"))
        assert not _cached(_config("auto", "td3", batch_size=8))  # another shape
    finally:
        trainer.close()


def _cached(config: OffPolicyConfig) -> bool:
    trainer = OffPolicyTrainer([config])
    trainer.close()
    return bool(trainer.decision.cached)


@pytest.mark.slow
def test_a_single_sac_pod_trains_with_the_compiled_update_and_saves_its_files(tmp_path) -> None:
    trainer = OffPolicyTrainer([_config("on")])
    try:
        # Its first steps fill the replay: no program has run, one will (an experiment's other
        # pods wait for its compile, services/pod/runtime/compile_share.py).
        trainer.step()
        assert trainer.updates == 0 and trainer.compiles_later
        with capture_logs() as logs:
            for _ in range(11):
                trainer.step()
        assert not trainer.compiles_later
        assert not [e for e in logs if e["event"] == "compile.failed"], logs
        assert trainer.learner.compiled and trainer.learner.updates == 10
        # Noted in the compile cache: auto in the next process counts its compile a load.
        assert cached(trainer.configs[0], trainer.program_key(), ["update"])
        assert _cached(_config("auto"))
        trainer.save(0, tmp_path)
        child = OffPolicyTrainer([_config("off")])
        child.load(0, tmp_path, _config("off"))
        mine, _ = trainer.single(0)
        theirs, _ = child.single(0)
        for name, value in mine.state_dict().items():
            torch.testing.assert_close(theirs.state_dict()[name], value, msg=name)
        steps = {float(s["step"]) for s in theirs.optimizer.state.values()}
        assert steps == {10.0}
        child.close()
        # A compiled child trains on from the loaded weights and Adam state (its stack's).
        child = OffPolicyTrainer([_config("on", seed=8)])
        child.load(0, tmp_path, _config("on", seed=8))
        parents, slot = child.population.weights(0, mine)
        assert all(torch.equal(a, b) for a, b in zip(parents, slot, strict=True))
        assert float(child.population.adams["params"].steps[0]) == 10.0
        assert int(child.learner.kstep.seed[0]) == 8
        child.close()
    finally:
        trainer.close()


@pytest.mark.nightly
@pytest.mark.parametrize("algorithm", ["sac", "td3"])
def test_the_compiled_update_solves_pendulum_within_the_eager_budget(algorithm: str) -> None:
    # The eager loop's check (test_offpolicy.py), 8 updates per call: one per vector step.
    # Nightly: a cold compile of the preset's update costs minutes on CI's 2-core machine; the
    # compiled update is checked against the eager one in CI (above).
    assert_solves(algorithm, "Pendulum-v1", 30_000, seed=1, compile="on", updates_per_call=8)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("algorithm", ["sac", "td3"])
def test_on_cuda_a_call_replays_as_one_cuda_graph_with_the_eager_numbers(algorithm: str) -> None:
    """The first call compiles and warms up, the second captures its K updates as one CUDA
    graph, the third replays it: the weights eager K-step calls give, no fallback logged."""
    fields, filled = _replay(3, device="cuda")
    compiled, eager = _stack(algorithm, 3, "cuda"), _stack(algorithm, 3, "cuda")
    run = KStep(compiled, fields, filled, BATCH, seeds=[5, 6, 7])
    reference = KStep(eager, fields, filled, BATCH, seeds=[5, 6, 7])
    with capture_logs() as logs:
        for first in (1, 5, 9):
            got = run(4, first, True)
            want = reference(4, first, False)
    torch.cuda.synchronize()
    assert not [e for e in logs if e["event"] == "compile.failed"], logs
    assert list(run._graphs) == [(4, 1 % compiled.policy_delay)]
    _assert_same_state(compiled, eager)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5, msg=name)
    # PBT's explore between replays: the graph reads the new values in place.
    compiled.hp["gamma"].fill_(0.5)
    eager.hp["gamma"].fill_(0.5)
    run(4, 13, True)
    reference(4, 13, False)
    _assert_same_state(compiled, eager)
