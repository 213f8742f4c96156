"""The Anakin trainer (services/pod/training/anakin_trainer.py) and its compiled evaluation
(anakin_eval.py): which PPO trainer ``compile`` picks and why, a slot takes any PPO pod's files
(and gives them back bit for bit), the evaluation scores what ``Evaluator`` scores, a PBT
exploit/explore in a compiled population compiles nothing, and a second process loads the
compiled programs from the cache directory instead of compiling them.

Its save/load contract in a fresh process is tests/pod/test_trainers.py's (kinds ``anakin``
and ``anakin-population``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from services.pod.algorithms import aot_program, compiled
from services.pod.algorithms.compiled import ANAKIN_AUTO, AnakinRule, anakin_auto
from services.pod.config import PPORunConfig
from services.pod.envs.cartpole import CartPoleEnv
from services.pod.roles.evaluator import Evaluator
from services.pod.runtime.metrics import PodMetrics
from services.pod.training import anakin_eval
from services.pod.training.anakin import PUREJAXRL_CARTPOLE, AnakinPPO
from services.pod.training.anakin_trainer import AnakinTrainer
from services.pod.training.checkpoint import read_files
from services.pod.training.fit import fit
from services.pod.training.onpolicy import OnPolicyTrainer, save_ppo_files
from services.pod.training.population_trainer import PopulationTrainer
from services.pod.training.presets import preset
from services.pod.training.trainer import Trainer, build_trainer, note_trained
from tests.pod.harness import ROOT
from tests.pod.plugins import register_plugin


def configs(
    n: int, compile: str = "off", env: str = "CartPole-v1", **ppo: object
) -> list[PPORunConfig]:
    """``n`` small CartPole configs as a pod makes them (seeds 5, 6, ...; per-agent learning
    rates), observation normalisation on so that its statistics are part of every check."""
    base = {**preset("ppo", env), "eval_episodes": 4, "eval_seed": 1234}
    out = []
    for i in range(n):
        fields = {"num_envs": 4, "norm_obs": True, "compile": compile, **ppo}
        fields["learning_rate"] = (3e-3, 5e-3, 8e-3)[i % 3]
        out.append(
            PPORunConfig.model_validate({**base, "seed": 5 + i, "ppo": {**base["ppo"], **fields}})
        )
    return out


def with_compile(cs: list[PPORunConfig], mode: str) -> list[PPORunConfig]:
    return [c.model_copy(update={"ppo": c.ppo.model_copy(update={"compile": mode})}) for c in cs]


# -- choosing the trainer ----------------------------------------------------------------------
def test_auto_follows_the_measured_rules(monkeypatch):
    """Faster, and paid for within the horizon: Anakin; slower, unmeasured or not paid for:
    eager, saying which."""
    wins = next(r for r in ANAKIN_AUTO if r.anakin_rate > r.eager_rate)
    p, batch = wins.agents[0], wins.batch[1]
    pays = int(2 * wins.compile_s / wins.saved_s(p, 1)) + 1
    assert anakin_auto("cpu", p, batch, pays) is None
    assert "costs more than it saves" in str(anakin_auto("cpu", p, batch, pays // 4))
    # Its programs already built (a warm cache of programs compiled ahead of time): no compile.
    assert anakin_auto("cpu", p, batch, pays // 4, compiled=True) is None
    # Earlier runs' eager seconds count towards the compile, and the reason names them.
    assert anakin_auto("cpu", p, batch, pays // 4, lost_s=wins.compile_s) is None
    assert "3 s lost eager by earlier runs" in str(anakin_auto("cpu", p, batch, 1, lost_s=3.0))
    # Enough evaluations, each faster compiled, pay for it too.
    evaluations = int(wins.compile_s / wins.eval_saved_s) + 1
    assert anakin_auto("cpu", p, batch, pays // 4, evaluations=evaluations) is None
    # A row where the eager trainer measured faster (none on the measured devices since
    # session 27's CPU rows): eager, however long the run.
    slower = AnakinRule("meta", (1, 1), (1, 1024), 1_000, 2_000, 1.0)
    monkeypatch.setattr(compiled, "ANAKIN_AUTO", (*ANAKIN_AUTO, slower))
    assert "measured faster" in str(anakin_auto("meta", 1, 256, 10**9))
    monkeypatch.undo()
    assert "unmeasured" in str(anakin_auto("cpu", 10_000, 256, 10**9))
    assert "unmeasured" in str(anakin_auto("meta", 1, 256, 10**9))


def test_compile_picks_the_trainer_and_every_fallback_says_why(tmp_path, monkeypatch):
    def chosen(cs, roles=None, horizon=None):
        with capture_logs() as logs:
            trainer = build_trainer(cs, roles, horizon)
        [line] = [entry for entry in logs if entry["event"] == "trainer.chosen"]
        trainer.close()
        return type(trainer), line

    assert chosen(configs(1, "on"))[0] is AnakinTrainer
    assert chosen(configs(2, "on"))[0] is AnakinTrainer
    cls, line = chosen(configs(1, "off"))
    assert cls is OnPolicyTrainer and line["reason"] == "compile: off"
    # auto: the rules, against the horizon (a pod's share of its budget).
    cls, line = chosen(configs(1, "auto"), horizon=1_000)
    assert cls is OnPolicyTrainer and line["reason"].startswith("auto: compiling")
    cls, line = chosen(configs(2, "auto", num_envs=16), horizon=10**9)
    assert cls is AnakinTrainer
    # Where a row says the eager trainer is faster (none on this CPU since session 27):
    # eager, however long the run.
    slower = AnakinRule("cpu", (64, 64), (1, 383), 1_000, 2_000, 1.0)
    monkeypatch.setattr(compiled, "ANAKIN_AUTO", (slower, *ANAKIN_AUTO))
    cls, line = chosen(configs(64, "auto", num_envs=16), horizon=10**9)
    assert cls is PopulationTrainer and "eager trainer measured faster" in line["reason"]
    monkeypatch.undo()
    # compile: on where it cannot: the eager trainer, a warning naming why.
    pendulum = configs(1, "on", env="Pendulum-v1", sde_sample_freq=0, norm_reward=False)
    cls, line = chosen(pendulum)
    assert cls is OnPolicyTrainer and line["log_level"] == "warning"
    assert "'Pendulum-v1' has no functional step" in line["reason"]
    cls, line = chosen(configs(1, "on", norm_reward=True))
    assert "does not have: norm_reward" in line["reason"]
    plugin = "from services.pod.envs.cartpole import CartPoleEnv\nclass Mine(CartPoleEnv): ...\n"
    envs = {"podium.envs": {"MyCartPole-v0": "my_cartpole:Mine"}}
    register_plugin(tmp_path, monkeypatch, "my_cartpole", plugin, envs)
    mine = [c.model_copy(update={"env": "MyCartPole-v0"}) for c in configs(1, "on")]
    cls, line = chosen(mine)
    assert cls is OnPolicyTrainer and "'MyCartPole-v0' has no functional step" in line["reason"]
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    cls, line = chosen(configs(2, "on"))
    assert cls is PopulationTrainer and "no C++ compiler" in line["reason"]


def test_auto_compiles_a_shape_once_its_eager_runs_have_cost_the_compile(tmp_path, monkeypatch):
    """A run too short for the compile to pay trains eagerly, and notes in the compile cache
    what the env steps it trained cost (the Anakin trainer's rates and evaluations, per the
    rule's row); a later run of the same programs counts that, and compiles once the two
    reach the compile (before, every such run trained eagerly and the cache never warmed).
    Where programs are not kept across processes (switched off here; CUDA), nothing is
    counted."""
    [config] = configs(1, "auto", num_steps=16)
    config = config.model_copy(update={"total_env_steps": 256, "eval_every_steps": 128})
    rule = compiled.anakin_rule("cpu", 1, config.ppo.batch_size)
    assert rule is not None

    def saved(env_steps: int) -> float:
        return rule.saved_s(1, env_steps) + env_steps / 128 * rule.eval_saved_s

    horizon = int(0.6 * rule.compile_s / saved(1))
    assert 0.5 * rule.compile_s < saved(horizon) < rule.compile_s  # one run: no, two: yes

    def chosen() -> tuple[Trainer, dict]:
        with capture_logs() as logs:
            trainer = build_trainer([config], None, horizon)
        [line] = [entry for entry in logs if entry["event"] == "trainer.chosen"]
        return trainer, line

    signature = AnakinTrainer.programs_of([config])
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "kept"))
    trainer, line = chosen()
    assert isinstance(trainer, OnPolicyTrainer) and line["reason"].startswith("auto: compiling")
    assert aot_program.eager_seconds(signature) == 0.0  # nothing trained yet
    # podium train's loop notes what it trains, at each evaluation.
    fit(config, trainer)
    assert trainer.env_steps == 256
    assert aot_program.eager_seconds(signature) == pytest.approx(saved(256))
    # The rest of a run as long as the horizon: one more such run would pay for the compile.
    note_trained(trainer, horizon - 256)
    trainer.close()
    assert aot_program.eager_seconds(signature) == pytest.approx(saved(horizon))
    trainer, line = chosen()
    assert isinstance(trainer, AnakinTrainer) and "reason" not in line
    trainer.close()

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "not-kept"))
    monkeypatch.setenv(aot_program.SWITCH, "0")
    for _ in range(3):
        trainer, line = chosen()
        assert isinstance(trainer, OnPolicyTrainer) and "lost eager" not in line["reason"]
        note_trained(trainer, horizon)
        trainer.close()
    assert aot_program.eager_seconds(signature) == 0.0


# -- files and PBT -----------------------------------------------------------------------------
def trained_single(tmp_path: Path, **ppo: object) -> tuple[OnPolicyTrainer, Path]:
    """A single PPO pod's agent, trained 3 iterations, and its training files."""
    [config] = configs(1, **ppo)
    single = OnPolicyTrainer([config.model_copy(update={"seed": 42})])
    for _ in range(3):
        single.step()
    single.save(0, tmp_path / "single")
    return single, tmp_path / "single"


def test_saving_builds_no_optimizer_and_writes_what_one_would_hold(tmp_path, monkeypatch):
    """A pod saves its agents at every evaluation, and a process's first ``torch.optim.Adam``
    imports torch._dynamo (about a second of a run whose programs load from the cache): the
    trainer writes Adam's state as the optimiser's ``state_dict`` holds it, without one."""
    trainer = AnakinTrainer(configs(1, num_steps=8, update_epochs=1))
    trainer.step()
    learner = trainer.learner(0)
    assert learner.agent.optimizer.state  # built: the slot's Adam state goes into it
    save_ppo_files(tmp_path / "built", learner, trainer.config(0))

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("saving built a torch optimizer")

    monkeypatch.setattr(torch.optim.Optimizer, "__init__", refuse)
    trainer.save(0, tmp_path / "unbuilt")
    built, unbuilt = read_files(tmp_path / "built"), read_files(tmp_path / "unbuilt")
    assert unbuilt.documents == built.documents  # the optimizer's param group among them
    assert unbuilt.tensors.keys() == built.tensors.keys()
    for name, tensors in built.tensors.items():
        assert tensors.keys() == unbuilt.tensors[name].keys()
        for key, tensor in tensors.items():
            assert torch.equal(tensor, unbuilt.tensors[name][key]), (name, key)
    assert float(unbuilt.tensors["optimizer"]["0.step"]) > 0


def test_a_slot_takes_a_ppo_pods_files_and_gives_them_back_unchanged(tmp_path):
    """PBT's exploit from any PPO pod: weights, Adam moments and step, observation
    statistics and counters go into slot 1; saved again they are the same files; the slot
    scores what the pod scored, and trains on from there while the others keep theirs."""
    single, files = trained_single(tmp_path)
    [expected] = single.evaluate()
    trainer = AnakinTrainer(configs(3))
    trainer.step()
    others = [trainer.learner(i).agent.state_dict() for i in (0, 2)]
    trainer.load(1, files, single.config(0))
    assert trainer.counters(1) == single.counters(0)
    assert trainer.evaluate()[1].episodes == expected.episodes
    trainer.save(1, tmp_path / "again")
    saved, again = read_files(files), read_files(tmp_path / "again")
    for name, tensors in saved.tensors.items():
        assert tensors.keys() == again.tensors[name].keys()
        for key, tensor in tensors.items():
            assert torch.equal(tensor, again.tensors[name][key]), (name, key)
    assert again.documents["counters"] == saved.documents["counters"]
    ppo = single.config(0).ppo
    assert (
        float(saved.tensors["optimizer"]["0.step"]) == 3 * ppo.update_epochs * ppo.num_minibatches
    )
    for i, before in zip((0, 2), others, strict=True):
        after = trainer.learner(i).agent.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
    trainer.step()
    assert trainer.counters(1).env_steps == single.counters(0).env_steps + trainer.step_env_steps


# -- the evaluation ----------------------------------------------------------------------------
def trained_run() -> AnakinPPO:
    config = PUREJAXRL_CARTPOLE.model_copy(update={"num_steps": 32, "update_epochs": 2})
    run = AnakinPPO(config, [0, 1, 2], total_env_steps=10**6)
    for _ in range(25):  # long enough for episodes of hundreds of steps
        run.step()
    return run


def test_the_evaluation_scores_what_the_evaluator_scores():
    """Same weights, same start states: the same return for every episode."""
    run = trained_run()
    start = anakin_eval.start_states(CartPoleEnv(num_envs=8, seed=7), 7, 3)
    results = anakin_eval.evaluate(run.shape, run.state, start)
    for i, result in enumerate(results):
        expected = Evaluator(CartPoleEnv(num_envs=8, seed=7), seed=7).evaluate(run.agent(i).policy)
        assert result.episodes == expected.episodes
    assert max(max(r.episodes) for r in results) > 100  # long episodes, not only failures


@pytest.mark.slow
def test_the_compiled_evaluation_equals_the_evaluator_statistically():
    """Compiled, the float rounding of inductor's kernels differs from eager's, and CartPole
    amplifies it: an episode may end a few steps apart. Each agent's mean stays within 5%."""
    run = trained_run()
    start = anakin_eval.start_states(CartPoleEnv(num_envs=8, seed=7), 7, 3)
    compiled = anakin_eval.evaluate(run.shape, run.state, start, compiled=True)
    for i, result in enumerate(compiled):
        expected = Evaluator(CartPoleEnv(num_envs=8, seed=7), seed=7).evaluate(run.agent(i).policy)
        assert result.mean == pytest.approx(expected.mean, rel=0.05)


@pytest.mark.slow
def test_pbt_in_a_compiled_population_compiles_nothing(tmp_path):
    """Explore (new hyperparameters), exploit (a parent's files into a slot) and a fresh agent
    into a slot: the same graphs run, no compile second is added."""
    from torch._dynamo.utils import counters

    shape = {"num_steps": 8, "update_epochs": 1}
    single, files = trained_single(tmp_path, **shape)
    trainer = build_trainer(configs(2, "on", **shape))
    assert isinstance(trainer, AnakinTrainer) and trainer.mode == "steps"
    trainer.step()
    trainer.evaluate()
    assert trainer.compile_seconds > 0
    graphs, seconds = counters["stats"]["unique_graphs"], trainer.compile_seconds
    programs = dict(aot_program.COUNTS)
    explored = single.config(0).ppo.model_copy(update={"clip_coef": 0.1, "gamma": 0.95})
    trainer.load(0, files, single.config(0).model_copy(update={"ppo": explored, "seed": 77}))
    fresh = trainer.config(1).model_copy(update={"seed": 99})
    trainer.reset(
        1, fresh.model_copy(update={"ppo": fresh.ppo.model_copy(update={"ent_coef": 0.1})})
    )
    trainer.step()
    results = trainer.evaluate()
    assert counters["stats"]["unique_graphs"] == graphs
    assert dict(aot_program.COUNTS) == programs
    assert trainer.compile_seconds == seconds
    assert float(trainer.run.hp["clip_coef"][0]) == pytest.approx(0.1)
    assert float(trainer.run.hp["ent_coef"][1]) == pytest.approx(0.1)
    assert len(results) == 2


def test_the_pod_exports_compile_seconds():
    from prometheus_client import generate_latest

    metrics = PodMetrics("e", "p")
    metrics.compiled(12.5)
    metrics.compiled(12.5)  # the trainer's total: no new seconds
    metrics.compiled(14.0)
    text = generate_latest(metrics.registry).decode()
    assert 'podium_pod_compile_seconds_total{experiment="e",pod="p"} 14.0' in text


# -- the compile cache -------------------------------------------------------------------------
CACHED = """
import json, sys
from pathlib import Path
from services.pod.runtime.compile_cache import use_compile_cache
use_compile_cache(Path(sys.argv[1]))
import torch
torch.set_num_threads(1)
from torch._dynamo.utils import counters
from tests.pod.test_anakin_trainer import configs, with_compile
from services.pod.algorithms import aot_program
from services.pod.training.anakin_trainer import AnakinTrainer
# Two build processes, whatever this machine's CPUs: the programs built ahead must be the
# very ones the trainer asks for (an agent dimension of 1 is where their inputs differed).
aot_program.builders = lambda: 2
cs = configs(1, "on", num_steps=8, update_epochs=1)
declined_before = AnakinTrainer.declines(with_compile(cs, "auto"), horizon_env_steps=20_000)
trainer = AnakinTrainer(cs)
trainer.step()
trainer.evaluate()
declined_after = AnakinTrainer.declines(with_compile(cs, "auto"), horizon_env_steps=20_000)
record = {"seconds": trainer.compile_seconds, **counters["inductor"], **aot_program.COUNTS}
record["declined"] = [d and d.reason for d in (declined_before, declined_after)]
print(json.dumps(record))
"""


@pytest.mark.slow
def test_a_second_process_loads_the_compiled_programs_from_the_cache(tmp_path):
    """The pod's cache directory (services/pod/runtime/compile_cache.py) on its volume: a
    restarted pod, or a PBT child's new pod, finds the graphs compiled and compiles less."""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("TORCHINDUCTOR")}

    def run() -> dict:
        done = subprocess.run(
            [sys.executable, "-c", CACHED, str(tmp_path / "cache")],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    # On a CPU the rollout chunk, the batch (GAE, layout, shuffles), the minibatch update and
    # the evaluation are programs compiled ahead of time
    # (services/pod/algorithms/aot_program.py): built once, then loaded. Where the cache
    # lacks them and there are cores, all at once before the first iteration, each in a
    # process of its own; none is built again on first use.
    assert first["built_ahead"] == first["built"] == first["loaded"] == 4
    assert second.get("built", 0) == 0 and second["loaded"] == 4
    assert second.get("fxgraph_cache_miss", 0) == 0  # nothing went through torch.compile
    assert second["seconds"] < 0.1 * first["seconds"]
    # compile: auto over a short horizon: the compile does not pay in a cold cache, and is
    # counted as paid once a trainer of these configs has built its programs.
    assert "costs more than it saves" in first["declined"][0]
    assert first["declined"][1] is None and second["declined"] == [None, None]


def test_a_pods_horizon_is_its_share_of_the_budget():
    """What a compile must pay for in a pod: the budget over its pods' agents, at least a
    round; without a budget, the configs' own (None)."""
    from services.api_client import LeaderboardClient
    from services.contracts.spec import load_spec
    from services.pod.runtime.rounds import PodRuntime

    spec = load_spec(
        ROOT / "examples" / "cartpole.yaml"
    )  # 2M env steps, up to 4 pods, rounds of 4,096
    unreachable = LeaderboardClient("http://127.0.0.1:9", "e", None)

    def horizon(**changes: object) -> int | None:
        changed = spec.model_copy(update=changes)
        return PodRuntime("e", "p", changed, unreachable).horizon_env_steps()

    assert horizon() == 2_000_000 // 4
    population = spec.population.model_copy(update={"agents_per_pod": 2})
    assert horizon(population=population) == 2_000_000 // 8
    assert horizon(budget=spec.budget.model_copy(update={"total_env_steps": 1_000})) == 4_096
    assert horizon(budget=spec.budget.model_copy(update={"total_env_steps": None})) is None
    unreachable.close()


@pytest.mark.slow
def test_a_population_pod_with_compile_on_trains_with_anakin_and_exports_compile_seconds(
    leaderboard, tmp_path
):
    """A pod end to end (the real leaderboard): ``compile: on`` pinned, its two agents are
    trained and evaluated by the Anakin trainer, each reported as a candidate, and the pod's
    metrics hold the seconds it compiled."""
    from prometheus_client import generate_latest

    from tests.pod.harness import register, runtime, stop_after

    spec = {
        "name": "anakin-pod",
        "env": {"name": "CartPole-v1"},
        "algorithms": {"ppo": 1.0},
        "search_space": {
            "learning_rate": {"type": "log_uniform", "low": 3e-3, "high": 1e-2},
            "compile": {"type": "choice", "values": ["on"]},
            "num_steps": {"type": "choice", "values": [8]},
        },
        "generator": {"strategy": "pbt"},
        "population": {"agents_per_pod": 2},
        "round": {"env_steps": 512},
        "evaluation": {"episodes": 4},
        "top_k": 16,
    }
    register(leaderboard, "ea", spec)
    rt = runtime(leaderboard, "ea", spec, "pod-a", tmp_path)
    stop_after(rt, lambda r: len(r.submissions) >= 4, timeout=400)
    assert isinstance(rt.trainer, AnakinTrainer)
    assert {s["member"] for s in rt.submissions} == {0, 1}
    text = generate_latest(rt.metrics.registry).decode()
    [line] = [x for x in text.splitlines() if x.startswith("podium_pod_compile_seconds_total")]
    assert rt.trainer.compile_seconds > 0
    assert float(line.split()[-1]) == pytest.approx(rt.trainer.compile_seconds)
    rt.close()


def test_reading_the_compile_clock_imports_no_compiler():
    """The trainer reads its compile clock twice per iteration; in a process that only loads
    programs compiled ahead of time, reading it must not import dynamo (about a second)."""
    code = (
        "import sys\n"
        "from services.pod.training.anakin_trainer import compile_clock\n"
        "compile_clock()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
