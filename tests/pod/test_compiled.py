"""One compile path and one rule (services/pod/algorithms/compiled.py), on PPO's trainer
(services/pod/training/onpolicy.py): the compiled iteration and evaluation of a functional env
give the eager numbers for every action kind, one agent and a population; PBT's explore and a
slot's load compile nothing new; a second process loads the programs from the compile cache;
``compile: auto`` decides from eager iterations timed on this machine; ``on`` that cannot be
honoured is refused, naming why; the trainer's line says what compiles.

Compiling costs a minute per program shape on a loaded 2-core CPU: the tests that compile are
``slow`` and share one shape where they can (one process shares dynamo's cache; the session
shares inductor's); the sweep over every env, one agent and two, is ``nightly``.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from structlog.testing import capture_logs

from services.contracts.algorithms.hyperparameters import HyperparameterError
from services.contracts.pod_activity import CACHED as IN_CACHE
from services.contracts.pod_activity import eager_for_a_cold_compile
from services.pod.algorithms import compiled, policies
from services.pod.algorithms.compiled import (
    CompileRefusedError,
    Decision,
    Program,
    compile_work,
    grad,
    machine_factor,
    per_agent,
)
from services.pod.config import PPORunConfig
from services.pod.roles.learner import chunk_length
from services.pod.runtime.metrics import PodMetrics
from services.pod.training.onpolicy import OnPolicyTrainer
from services.pod.training.presets import preset
from tests.pod.harness import ROOT, compile_counters

FUNCTIONAL = [
    "CartPole-v1",
    "Acrobot-v1",
    "Pendulum-v1",
    "MountainCarContinuous-v0",
    "StockTrading-v0",
]

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def configs(env: str, agents: int = 1, compile: str = "on", **ppo: Any) -> list[PPORunConfig]:
    """Small configs of the env's preset (its settings: gSDE and reward normalisation on
    Pendulum, float64 accounts on StockTrading), ``agents`` agents with their own rates."""
    base = preset("ppo", env)
    small = {"num_envs": 4, "num_steps": 8, "num_minibatches": 2, "update_epochs": 2}
    fields = {**base.get("ppo", {}), **small, **ppo, "compile": compile}
    out = []
    for i in range(agents):
        raw = {**base, "seed": 3 + i, "eval_episodes": 2, "ppo": fields}
        raw["ppo"] = {**fields, "learning_rate": fields.get("learning_rate", 3e-4) * (1 + i)}
        out.append(PPORunConfig.model_validate(raw))
    return out


def assert_same(a: OnPolicyTrainer, b: OnPolicyTrainer) -> None:
    for key, value in a.population.state.items():
        torch.testing.assert_close(value, b.population.state[key], rtol=1e-4, atol=1e-5, msg=key)


def compiled_equals_eager(env: str, agents: int, **ppo: Any) -> OnPolicyTrainer:
    fast = OnPolicyTrainer(configs(env, agents, "on", **ppo))
    slow = OnPolicyTrainer(configs(env, agents, "off", **ppo))
    for _ in range(2):
        fast.step()
        slow.step()
    assert_same(fast, slow)
    returns = [[e for r in t.evaluate() for e in r.episodes] for t in (fast, slow)]
    assert returns[0] == pytest.approx(returns[1], rel=1e-4)
    assert fast.compile_seconds > 0 and slow.compile_seconds == 0
    return fast


@pytest.mark.slow
def test_the_compiled_iteration_and_evaluation_give_the_eager_numbers() -> None:
    """Continuous actions with gSDE and reward normalisation, a population of two: two
    compiled iterations and a compiled evaluation give what the same functions give eager
    (every env, discrete actions and one agent: the nightly sweep below). 16 sub-envs in all:
    4 steps per rollout call, so gSDE's noise (new every 4 steps) is drawn at each call's
    first step only, where the eager rollout checks every step."""
    trainer = compiled_equals_eager("Pendulum-v1", 2, num_envs=8)
    assert trainer.compiled.startswith("compiled (rollout, update, evaluation")


@pytest.mark.nightly
@pytest.mark.parametrize("agents", [1, 2])
@pytest.mark.parametrize("env", FUNCTIONAL)
def test_every_functional_env_trains_compiled_with_the_eager_numbers(env: str, agents: int):
    compiled_equals_eager(env, agents)


@pytest.mark.slow
def test_pbt_changes_values_and_compiles_nothing(tmp_path) -> None:
    """PBT's explore (new hyperparameters in the (P,) tensors) and exploit (a slot loaded from
    another agent's files, a slot reset) reuse every program. (The shape of the test above:
    in one process its programs are compiled already.)"""
    trainer = OnPolicyTrainer(configs("Pendulum-v1", 2))
    trainer.step()
    trainer.evaluate()
    trainer.save(0, tmp_path / "parent")
    before, seconds = compile_counters(), trainer.compile_seconds
    child = trainer.config(1)
    child = child.model_copy(update={"ppo": child.ppo.model_copy(update={"clip_coef": 0.1})})
    trainer.load(1, tmp_path / "parent", child)
    trainer.reset(0, trainer.config(0).model_copy(update={"seed": 99}))
    trainer.step()
    trainer.evaluate()
    assert compile_counters() == before and trainer.compile_seconds == seconds
    assert float(trainer.population.hp["clip_coef"][1]) == pytest.approx(0.1)


CACHED = """
import json, sys
from pathlib import Path
from services.pod.runtime.compile_cache import use_compile_cache
use_compile_cache(Path(sys.argv[1]))
import torch
torch.set_num_threads(1)
from tests.pod.test_compiled import configs
from services.pod.algorithms.compiled import compile_work
from services.pod.training.onpolicy import OnPolicyTrainer
auto = OnPolicyTrainer(configs("CartPole-v1", compile="auto")).decision.cached
trainer = OnPolicyTrainer(configs("CartPole-v1"))
trainer.step()
trainer.evaluate()
work = compile_work()
print(json.dumps({"seconds": trainer.compile_seconds, "cached": auto,
                  "built": work.built, "loaded": work.loaded}))
"""


@pytest.mark.nightly
def test_a_second_process_loads_the_programs_from_the_cache(tmp_path) -> None:
    """The pod's cache directory (services/pod/runtime/compile_cache.py) on its volume: a
    restarted pod, or a PBT child's, loads the compiled graphs instead of building them, and
    ``auto`` counts their compile as a load. (Nightly: two cold processes; the test command
    sees the same loads in tests/e2e/test_compile_once.py and the pod image's tests, and
    ``auto``'s marker in the test below.)"""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("TORCHINDUCTOR")}

    def run() -> dict:
        done = subprocess.run(
            [sys.executable, "-c", CACHED, str(tmp_path / "cache")],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["built"] >= 4 and first["loaded"] == 0 and first["cached"] is False
    assert second["built"] == 0 and second["loaded"] >= 4
    assert second["cached"] is True
    assert second["seconds"] < first["seconds"]


KEY = """
from tests.pod.test_compiled import configs
from services.pod.training.onpolicy import OnPolicyTrainer
print(OnPolicyTrainer(configs("Pendulum-v1", compile="off")).program_key())
"""


def test_the_programs_key_is_the_same_in_every_process() -> None:
    """What the compile cache's notes are keyed by names no object's address: a second
    process (a restarted pod, a PBT child) finds the programs the first compiled."""

    def key() -> str:
        done = subprocess.run(
            [sys.executable, "-c", KEY], cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    first = key()
    assert " at 0x" not in first and first == key()


@pytest.mark.slow
def test_auto_counts_a_load_only_when_every_program_is_in_the_cache(monkeypatch, tmp_path):
    """A short run that compiled only the evaluation leaves no iteration in the cache: the
    next trainer of that key counts a cold compile, not a load of both."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    short = OnPolicyTrainer(configs("CartPole-v1", compile="on"))
    short.evaluate()  # compiles the evaluation, and notes it
    short.close()
    assert OnPolicyTrainer(configs("CartPole-v1", compile="auto")).decision.cached is False
    compiled.mark_cached(short.configs[0], short.program_key(), "iteration")
    assert OnPolicyTrainer(configs("CartPole-v1", compile="auto")).decision.cached is True


def test_the_cache_lookup_finds_the_directory_inductor_uses(monkeypatch, tmp_path) -> None:
    """The compile cache's directory is found without importing inductor (a second of every
    eager run): the same as inductor's own answer, set or by default (a torch upgrade that
    moves its default fails here)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert compiled.inductor_cache_dir() == Path(cache_dir())
    assert compiled.inductor_cache_dir().parent == tmp_path
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "pod"))
    assert compiled.inductor_cache_dir() == Path(cache_dir()) == tmp_path / "pod"


def test_an_empty_cache_setting_is_unset_for_inductor_too(monkeypatch, tmp_path) -> None:
    """``TORCHINDUCTOR_CACHE_DIR=""`` (an empty value in a manifest) is no setting: the pod's
    set-up and inductor agree on torch's default, where inductor alone would take the pod's
    working directory for its kernels."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from services.pod.runtime.compile_cache import FLAGS, use_compile_cache

    for name, value in FLAGS.items():  # restored after the test: use_compile_cache sets them
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.chdir(tmp_path / "..")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")
    assert use_compile_cache(None) is None
    assert Path(cache_dir()) == compiled.inductor_cache_dir()
    assert Path(cache_dir()).parent == tmp_path


def test_a_compile_that_failed_is_not_noted_in_the_cache(monkeypatch, tmp_path) -> None:
    """``auto`` trains eager after a program fails to compile, and notes nothing: the next
    trainer of that key must not count the program as a cheap load."""
    from services.pod.roles import evaluator, learner

    def host_reading(*args: Any) -> Any:
        out = evaluator.greedy_steps(*args)  # traced first: the failure costs compile seconds
        if float(out[0]) < 0:  # never, but read on the host: fullgraph refuses
            raise AssertionError
        return out

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(learner, "_EVALUATE", compiled.Program(host_reading, "evaluate"))
    trainer = OnPolicyTrainer(configs("CartPole-v1", compile="auto"))
    trainer.decision.compiled = True  # as auto decides where compiling pays
    with capture_logs() as logs:
        trainer.evaluate()
    assert [e["fallback"] for e in logs if e["event"] == "compile.failed"] == ["eager"]
    assert trainer.compile_seconds > 0 and trainer.decision.compiled is False
    assert not compiled.cached(trainer.configs[0], trainer.program_key(), ["evaluate"])
    trainer.close()


def test_the_trainer_says_what_compiles_for_every_functional_env() -> None:
    """``compile: on``: every functional env trains its whole iteration compiled, one agent and
    a population (nothing compiles before the first step); a host-stepped env compiles its
    update and steps on the host, and says so."""
    for env in FUNCTIONAL:
        for agents in (1, 2):
            trainer = OnPolicyTrainer(configs(env, agents))
            assert trainer.compiled.startswith("compiled (rollout, update, evaluation"), env
            trainer.close()
    host = [c.model_copy(update={"env": "gym:CartPole-v1"}) for c in configs("CartPole-v1")]
    trainer = OnPolicyTrainer(host)
    assert trainer.compiled.startswith("compiled (update")
    assert "rollout and evaluation on the host (env 'gym:CartPole-v1' has no functional step)" in (
        trainer.compiled
    )
    trainer.close()
    off = OnPolicyTrainer(configs("Pendulum-v1", compile="off"))
    assert off.compiled == "eager (compile: off)"


def test_auto_times_eager_iterations_and_compiles_where_it_pays(monkeypatch) -> None:
    """``auto``: the first iterations run eager and are timed; the compile is chosen where the
    rest of the run saves more than it costs (both sides scaled by this machine)."""
    trainer = OnPolicyTrainer(configs("CartPole-v1", compile="auto"))
    assert trainer.decision.compiled is None and trainer.compiled.startswith("deciding")
    monkeypatch.setitem(compiled.RULES, ("onpolicy", "cpu"), compiled.Rule(3.0, 1e9, 1e9))
    for _ in range(4):
        trainer.step()
    assert trainer.decision.compiled is False
    assert trainer.compiled.startswith("eager (auto: eager: the compiled programs save about")
    d = Decision("auto", "onpolicy", torch.device("cpu"), units=1e9)
    monkeypatch.setitem(compiled.RULES, ("onpolicy", "cpu"), compiled.Rule(3.0, 1.0, 0.1))
    for _ in range(4):
        d.eager_call(0.01, 100)
    assert d.compiled is True and "compiling" in d.reason
    # A compile in the cache is a load: it pays where a cold one would not.
    monkeypatch.setitem(compiled.RULES, ("onpolicy", "cpu"), compiled.Rule(3.0, 1e6, 1e-3))
    cold = Decision("auto", "onpolicy", torch.device("cpu"), units=1e6)
    warm = Decision("auto", "onpolicy", torch.device("cpu"), units=1e6, cached=True)
    for decision in (cold, warm):
        decision.decide(1e-3, 1e6)
    assert (cold.compiled, warm.compiled) == (False, True)


def test_a_load_costs_the_compiler_import_only_where_it_is_not_imported(monkeypatch) -> None:
    """A pod forked from the launcher has the compiler imported: a load from the cache costs it
    a fraction of a second, not the seconds a fresh process spends importing the compiler, and
    a short run that a load pays for compiles there."""
    import torch._inductor.compile_fx

    monkeypatch.setattr(compiled, "machine_factor", lambda: 1.0)
    rule = compiled.RULES["onpolicy", "cpu"]
    saved_s = 2 * rule.warm_s  # more than a load, less than the import and a load
    units = saved_s / (1e-3 * (1 - 1 / rule.speedup))
    assert rule.warm_s < saved_s < rule.warm_s + compiled.COMPILER_IMPORT_S
    forked = Decision("auto", "onpolicy", torch.device("cpu"), units, cached=True)
    # Cached, with the compiler imported: it loads at once, without timing eager calls (which
    # would cost more than the load); not cached, it times them first.
    assert forked.compiled is True and forked.reason == f"auto: compiling: a load {IN_CACHE}"
    assert Decision("auto", "onpolicy", torch.device("cpu"), units).compiled is None
    forked.decide(1e-3, units)
    monkeypatch.delitem(sys.modules, compiled.COMPILER[-1])
    fresh = Decision("auto", "onpolicy", torch.device("cpu"), units, cached=True)
    assert fresh.compiled is None
    fresh.decide(1e-3, units)
    assert (forked.compiled, fresh.compiled) == (True, False), (forked.reason, fresh.reason)


def test_a_pod_that_auto_trains_eager_for_want_of_a_compile_says_so_in_its_log(
    monkeypatch,
) -> None:
    """``podium run`` reads from its pods' logs that ``auto`` trained eager where only a cold
    compile made it (then it names ``podium compile``): a cold cache's decision that a load
    would have flipped says so; one that compiles, one that a load would not have flipped
    (too short a run), or one already weighing a load, does not."""
    monkeypatch.setitem(compiled.RULES, ("onpolicy", "cpu"), compiled.Rule(3.0, 1e6, 1e-3))
    logs: dict[str, str] = {}
    reasons: dict[str, str] = {}
    cases = {"cold": (False, 1e6), "warm": (True, 1e6), "short": (False, 1), "loaded": (True, 1),
             # A load would save a little more than it costs: not worth advising a compile for
             # (a rerun's timing decided eager: the quickstart's pods after `podium compile`).
             "marginal": (False, 2)}  # fmt: skip
    for name, (cached, units) in cases.items():
        with capture_logs() as records:
            decision = Decision("auto", "onpolicy", torch.device("cpu"), units, cached=cached)
            decision.decide(1e-3, units)
        lines = ["not json", json.dumps(["compile.decided"]), *(json.dumps(r) for r in records)]
        logs[name] = "\n".join(lines)
        reasons[name] = decision.reason
        assert decision.compiled is (name == "warm"), name
    assert reasons["cold"].startswith("auto: eager: the compiled programs save")
    assert eager_for_a_cold_compile(logs["cold"]) == reasons["cold"]
    for name in ("warm", "short", "loaded", "marginal"):
        assert eager_for_a_cold_compile(logs[name]) is None, name
    # Both sides of a decision are weighed with one machine factor: a load average that moves
    # between two reads must not make a decision over the cache say a load would have turned it.
    factors = iter([100.0, 1.0])
    monkeypatch.setattr(compiled, "machine_factor", lambda: next(factors, 1.0))
    with capture_logs() as records:
        decision = Decision("auto", "onpolicy", torch.device("cpu"), 10, cached=True)
        decision.decide(1e-3, 10)
    assert decision.compiled is False
    assert eager_for_a_cold_compile("\n".join(json.dumps(r) for r in records)) is None


def test_the_compile_estimate_scales_with_the_machine(monkeypatch) -> None:
    """A busy machine compiles slower: its load over its CPUs raises the estimate."""
    quiet = machine_factor()
    monkeypatch.setattr("os.getloadavg", lambda: (64.0, 64.0, 64.0))
    # The load average is the machine's: per CPU of the machine, not of this process.
    assert machine_factor() > quiet and machine_factor() >= 64.0 / (__import__("os").cpu_count())


def test_on_that_cannot_be_honoured_is_refused_naming_why(monkeypatch, tmp_path) -> None:
    """No C++ compiler: ``compile: on`` is refused (the pod exits "bad input", ``podium
    train`` says why); ``auto`` trains eager and says why."""
    monkeypatch.setenv("CXX", str(tmp_path / "g++"))
    with pytest.raises(CompileRefusedError, match=r"no C\+\+ compiler") as info:
        OnPolicyTrainer(configs("CartPole-v1"))
    assert isinstance(info.value, HyperparameterError)
    trainer = OnPolicyTrainer(configs("CartPole-v1", compile="auto"))
    assert trainer.compiled.startswith("eager (auto: no C++ compiler")


def test_compile_is_a_checked_field() -> None:
    with pytest.raises(ValidationError, match="ppo.compile"):
        PPORunConfig.model_validate({"ppo": {"compile": "sometimes"}})


def test_grad_and_per_agent_are_torch_funcs_whatever_the_mode() -> None:
    """The eager forms of ``torch.func.grad`` and ``vmap`` (autograd; a single agent's row)
    give what the transforms give."""

    def loss(w: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.tanh(x @ w["a"]) @ w["b"]
        return y.square().sum(), y.detach()

    g = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(4, 2, generator=g)}
    x = torch.randn(5, 3, generator=g)
    mine, aux = grad(loss)(w, x)
    theirs, aux2 = torch.func.grad(loss, has_aux=True)(w, x)
    for key in w:
        torch.testing.assert_close(mine[key], theirs[key])
    torch.testing.assert_close(aux, aux2)
    one = {k: v.unsqueeze(0) for k, v in w.items()}
    torch.testing.assert_close(
        per_agent(lambda w, x: loss(w, x)[0])(one, x.unsqueeze(0)),
        torch.vmap(lambda w, x: loss(w, x)[0])(one, x.unsqueeze(0)),
    )


def test_the_pod_exports_compile_seconds() -> None:
    from prometheus_client import generate_latest

    metrics = PodMetrics("e", "p")
    metrics.compiled(12.5)
    metrics.compiled(12.5)  # the trainer's total: no new seconds
    metrics.compiled(14.0)
    text = generate_latest(metrics.registry).decode()
    assert 'podium_pod_compile_seconds_total{experiment="e",pod="p"} 14.0' in text


def test_a_pods_horizon_is_its_share_of_the_budget_or_near_its_target() -> None:
    """What a compile must pay for in a pod: the budget over its pods' agents, at least a
    round; without a budget, the configs' own (None). With a target, at most twice the env
    steps the preset's runs took to reach theirs: the tournament stops there (a SAC
    tournament on Pendulum, target -200, solves in about 10k env steps, not its 1M budget)."""
    from services.api_client import LeaderboardClient
    from services.contracts.spec import load_spec
    from services.pod.runtime.rounds import PodRuntime
    from services.pod.training.presets import pod_config

    unreachable = LeaderboardClient("http://127.0.0.1:9", "e", None)

    def horizon(example: str, **changes: object) -> int | None:
        changed = load_spec(ROOT / "examples" / example).model_copy(update=changes)
        pod = PodRuntime("e", "p", changed, unreachable)
        return pod.horizon_env_steps(pod_config(changed, {}, 0))

    for example in ("cartpole.yaml", "pendulum-sac.yaml"):
        spec = load_spec(ROOT / "examples" / example)
        expected = pod_config(spec, {}, 0).expected_env_steps
        assert expected and spec.target_return is not None
        share = spec.budget.total_env_steps // spec.population.max_pods
        assert share > 2 * expected
        assert horizon(example) == 2 * expected  # the target's, not the budget's
        assert horizon(example, target_return=None) == share
        small = spec.budget.model_copy(update={"total_env_steps": 1_000})
        assert horizon(example, target_return=None, budget=small) == spec.round.env_steps
        unlimited = spec.budget.model_copy(update={"total_env_steps": None})
        assert horizon(example, target_return=None, budget=unlimited) is None
        assert horizon(example, budget=unlimited) == 2 * expected
    unreachable.close()


def test_reading_the_compile_work_imports_no_compiler() -> None:
    """A trainer reads what it compiled around every step: in a process that compiled
    nothing, that must not import dynamo (about a second)."""
    code = (
        "import sys\n"
        "from services.pod.algorithms.compiled import compile_work\n"
        "compile_work()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
    assert compile_work().seconds >= 0


@pytest.mark.gpu
@pytest.mark.slow
@CUDA
def test_on_cuda_the_iteration_replays_as_one_cuda_graph_and_sees_new_hyperparameters() -> None:
    gpu = [c.model_copy(update={"device": "cuda"}) for c in configs("Pendulum-v1", 2)]
    eager = [c.model_copy(update={"ppo": c.ppo.model_copy(update={"compile": "off"})}) for c in gpu]
    fast, slow = OnPolicyTrainer(gpu), OnPolicyTrainer(eager)
    for _ in range(3):
        fast.step()
        slow.step()
    assert fast.population._graph is not None and fast.population._graph.failed is None
    assert_same(fast, slow)
    for t in (fast, slow):
        t.population.hp["clip_coef"].fill_(0.05)
    fast.step()
    slow.step()
    assert_same(fast, slow)


def test_a_program_holds_a_graph_per_env_past_dynamos_default_limit() -> None:
    """A process may train more envs and shapes than dynamo's default of 8 graphs per code
    object (a test session did: its ninth env's rollout failed to compile)."""
    program = Program(lambda x, k: x * k + 1, "scale")
    x = torch.ones(3)
    for k in range(10):
        assert program(x.device, x, k).tolist() == [k + 1.0] * 3


def test_a_program_called_with_other_constants_runs_their_graph() -> None:
    """A program runs its built graph directly; another trainer's constants (a new shape, env
    or module) must still find their own graph, not the last one's."""
    program = Program(lambda x, k: x * k, "times")
    x = torch.ones(2)
    for _ in range(3):
        assert program(x.device, x, 2).tolist() == [2.0, 2.0]
    assert program(x.device, x, 3).tolist() == [3.0, 3.0]
    assert program(x.device, x, 2).tolist() == [2.0, 2.0]


def _scale(x: torch.Tensor, k: int) -> torch.Tensor:
    return x * k


def test_a_built_graph_runs_directly_and_another_program_of_it_loads_it(
    monkeypatch, tmp_path
) -> None:
    """A built graph runs whenever a call's arguments are of its kind, with nothing compiled;
    another shape, constant or grad mode builds its own; a new program of the same function
    (as a later process has) loads the saved graphs instead of building them."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x, longer = torch.ones(2), torch.ones(3)

    def work(program: Program, *args: Any) -> tuple[int, int]:
        before = compile_work()
        assert program(x.device, *args).tolist() == [args[1] * 1.0] * len(args[0])
        done = compile_work() - before
        return done.built, done.loaded

    program = Program(_scale, "direct")
    assert work(program, x, 2) == (1, 0)
    assert work(program, x, 2) == (0, 0)
    assert work(program, longer, 2) == (1, 0)
    assert work(program, x, 3) == (1, 0)
    with torch.no_grad():
        assert work(program, x, 2) == (1, 0)
    assert work(program, x, 2) == (0, 0)
    again = Program(_scale, "direct")
    assert work(again, x, 2) == (0, 1)
    assert work(again, longer, 2) == (0, 1)
    assert work(again, x, 2) == (0, 0)


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    return x + k


def test_a_saved_graph_is_loaded_only_for_what_it_was_built_from(monkeypatch, tmp_path) -> None:
    """The saved guards do not check which function or objects a graph was traced from: the
    key does. Another function under the same program name, or the same function closing over
    another value, builds its own graph; a corrupt file is refused and built again."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x = torch.ones(2)

    def run(fn: Any) -> tuple[list[float], int, int]:
        before = compile_work()
        out = Program(fn, "same")(x.device, x, 3).tolist()
        done = compile_work() - before
        return out, done.built, done.loaded

    assert run(_scale) == ([3.0, 3.0], 1, 0)
    assert run(_shift) == ([4.0, 4.0], 1, 0)
    assert run(_scale) == ([3.0, 3.0], 0, 1)

    def closing_over(factor: float) -> Any:
        return lambda x, k: x * k * factor

    assert run(closing_over(2.0)) == ([6.0, 6.0], 1, 0)
    assert run(closing_over(5.0)) == ([15.0, 15.0], 1, 0)
    for saved in (tmp_path / "podium-programs").glob("*.graph"):
        saved.write_bytes(b"not a pickle")
    with capture_logs() as logs:
        assert run(_scale) == ([3.0, 3.0], 1, 0)
    assert any(e["event"] == "compile.load_failed" for e in logs)


LOADS = """
import json, subprocess, sys
import torch
commands = []
_popen = subprocess.Popen.__init__
def _record(self, args, *rest, **kwargs):
    commands.append(args if isinstance(args, str) else " ".join(map(str, args)))
    _popen(self, args, *rest, **kwargs)
subprocess.Popen.__init__ = _record
from services.pod.runtime.compile_cache import use_compile_cache
use_compile_cache(__import__("pathlib").Path(sys.argv[1]))
from services.pod.algorithms.compiled import Program, compile_work
from tests.pod.test_compiled import _scale
device = torch.device(sys.argv[2])
out = Program(_scale, "scale")(device, torch.ones(4, device=device), 3)
from torch._dynamo.utils import compilation_time_metrics as timed
work = compile_work()
print(json.dumps({"out": out.tolist(), "built": work.built, "loaded": work.loaded,
                  "traced": len(timed.get("bytecode_tracing", ())),
                  "preprocessed": [c for c in commands if " -E " in f" {c} "]}))
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
def test_a_later_process_loads_a_graph_without_tracing_it(tmp_path, device: str) -> None:
    """What a restarted pod, a PBT child's pod or another pod of the experiment pays for a
    compiled program is its load: the guards and kernels from the compile cache, with no
    trace of the function (dynamo's trace was most of a load's seconds) and no run of the C++
    preprocessor (inductor's precompiled header is found again by preprocessing torch's
    headers: most of what was left). Also where the environment turns torch's graph caches
    off: a graph is saved as their entry."""
    env = {**os.environ, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}

    def run() -> dict:
        done = subprocess.run(
            [sys.executable, "-c", LOADS, str(tmp_path / "cache"), device],
            cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["out"] == second["out"] == [3.0] * 4
    assert (first["built"], first["loaded"]) == (1, 0) and first["traced"] > 0, first
    assert (second["built"], second["loaded"]) == (0, 1) and second["traced"] == 0, second
    assert second["preprocessed"] == [], second


def test_a_bound_program_runs_its_graph_without_guards_until_the_objects_change(
    monkeypatch,
) -> None:
    """A trainer binds each program: once bound, a call with the same objects (its shape,
    env, counts) and grad mode runs the graph without checking its guards; another object or
    grad mode finds (or builds) its own graph through the guards, never the bound one."""
    program = Program(lambda x, k: x * k, "bound")
    looked_up: list[tuple] = []
    graph_for = program._graph_for
    monkeypatch.setattr(program, "_graph_for", lambda a: looked_up.append(a) or graph_for(a))
    bound = program.bind(torch.device("cpu"))
    x = torch.ones(2)

    def lookups(call) -> int:
        before = len(looked_up)
        call()
        return len(looked_up) - before

    def check(k: int, value: float = 1.0) -> None:
        assert bound(torch.full((2,), value), k).tolist() == [k * value] * 2

    assert lookups(lambda: check(2)) > 0  # compiles
    assert lookups(lambda: check(2)) == 1  # finds the graph through its guards: bound
    for value in (3.0, 5.0):  # new values, the same kind of tensor: the bound graph
        assert lookups(functools.partial(check, 2, value)) == 0
    assert lookups(lambda: check(3)) > 0  # another constant: its own graph
    assert lookups(lambda: check(3)) == 1
    assert lookups(lambda: check(3)) == 0
    assert lookups(lambda: check(2)) == 1  # the first graph, found again
    with torch.no_grad():
        assert lookups(lambda: check(2)) > 0
    assert bound(x, 2).tolist() == [2.0, 2.0]


def test_a_rollout_call_unrolls_fewer_steps_where_a_vector_step_is_many_envs() -> None:
    """The compile grows with the steps a call of the rollout unrolls, and a call's host time
    counts only against a few sub-environments' step: the most steps (8) below 16 sub-envs of
    all agents, half as many from there on; always a divisor of the iteration's steps."""
    assert chunk_length(128, 4) == 8  # PureJaxRL's CartPole recipe, one agent
    assert chunk_length(128, 15) == 8
    assert chunk_length(16, 16) == 4  # the CartPole preset
    assert chunk_length(16, 4 * 4) == 4  # four agents of four envs
    assert chunk_length(10, 2048) == 2  # PureJaxRL's Pendulum recipe: 10's divisors
    assert chunk_length(6, 4) == 6
    assert chunk_length(7, 64) == 1


@pytest.mark.parametrize("agents, rows", [(1, 4), (2, 4), (1, 1)])
def test_a_compiled_mlp_of_few_rows_calls_no_matmul_and_gives_the_eager_numbers(agents, rows):
    """At most ``FUSED_ROWS`` rows of all agents (one agent's rollout step of a few envs), the
    compiled MLP's layers are fused multiply-sums, not calls of the matmul library; more rows
    are batched matmuls. Outputs and gradients are the eager ones either way."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    layers = ("l0", "l1", "l2")
    params = {}
    for name, (out, inp) in zip(layers, [(64, 4), (64, 64), (2, 64)], strict=True):
        params |= {f"{name}.weight": torch.randn(agents, out, inp) / 8}
        params |= {f"{name}.bias": torch.randn(agents, out)}
    x = torch.randn(agents, rows, 4)

    def forward(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return policies.mlp_forward(params, layers, "tanh", x)[0]

    results = []
    for fn in (torch.compile(forward, fullgraph=True, dynamic=False), forward):
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        out, code = run_and_get_code(fn, leaves, x)
        out.square().sum().backward()
        results.append((out, leaves["l0.weight"].grad, code))
    (out, grad, code), (eager_out, eager_grad, _) = results
    torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, eager_grad, rtol=1e-4, atol=1e-5)
    fused = agents * rows <= policies.FUSED_ROWS
    assert ("bmm" not in "\n".join(code)) is fused
