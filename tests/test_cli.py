"""`podium train` as a user runs it: a real subprocess, real files, clear errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.pod.training.checkpoint import read_files

PODIUM = [sys.executable, "-m", "services.cli"]


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*PODIUM, *args], capture_output=True, text=True, timeout=300, cwd=cwd, check=False
    )


def test_train_writes_checkpoints_curve_and_metrics(tmp_path):
    out = tmp_path / "run"
    proc = run(
        "train", "CartPole-v1", "--out", str(out), "--quiet",
        "--set", "total_env_steps=8192", "--set", "eval_every_steps=4096",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    png = (out / "learning_curve.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5_000
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["env_steps"] == 8192
    assert sum("eval_return" in r for r in records) == 2
    for which in ("latest", "best"):
        files = read_files(out / "checkpoints" / which)
        assert files.documents["counters"]["env_steps"] in (4096, 8192)
        assert files.documents["hyperparameters"]["env"] == "CartPole-v1"
    assert json.loads((out / "config.json").read_text())["total_env_steps"] == 8192


def test_config_file_and_set_layering(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("total_env_steps: 4096\nppo:\n  num_envs: 16\n  learning_rate: 0.01\n")
    out = tmp_path / "run"
    proc = run(
        "train", "Pendulum-v1", "--config", str(config), "--set", "ppo.learning_rate=2e-3",
        "--out", str(out), "--quiet",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    saved = json.loads((out / "config.json").read_text())
    assert saved["total_env_steps"] == 4096
    assert saved["ppo"]["num_envs"] == 16
    assert saved["ppo"]["learning_rate"] == 2e-3
    assert saved["ppo"]["sde_sample_freq"] > 0  # the rest of the Pendulum preset stays


def test_compile_on_and_off_as_yaml_reads_them():
    """YAML 1.1 reads a bare on/off as a boolean: ``--set ppo.compile=on`` and ``compile: off``
    in a config file mean the words, for PPO and the off-policy loop; other values are
    still refused."""
    from pydantic import ValidationError

    from services.cli.overrides import parse_set
    from services.pod.training.presets import train_config

    assert train_config("CartPole-v1", [parse_set("ppo.compile=on")]).ppo.compile == "on"
    assert train_config("CartPole-v1", [{"ppo": {"compile": False}}]).ppo.compile == "off"
    sac = [parse_set("algorithm=sac"), parse_set("compile=off")]
    assert train_config("Pendulum-v1", sac).compile == "off"  # type: ignore[attr-defined]
    with pytest.raises(ValidationError, match="'auto', 'on' or 'off'"):
        train_config("CartPole-v1", [parse_set("ppo.compile=3")])


def test_train_says_what_the_trainer_compiles_and_why(tmp_path):
    """The CLI shows no logs; which trainer trains (and so how fast) is said in one line."""
    proc = run(
        "train", "CartPole-v1", "--out", str(tmp_path / "run"),
        "--set", "total_env_steps=2048", "--set", "eval_every_steps=2048",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # auto times its first eager iterations, then says what it decided, a line each.
    first, decided = [x for x in proc.stderr.splitlines() if x.startswith("trainer: ")]
    assert first == "trainer: OnPolicyTrainer, deciding (auto: timing the first eager iterations)"
    assert decided.startswith("trainer: OnPolicyTrainer, eager (auto: eager: the compiled")
    assert re.search(r"compiling costs about \d+\.\d s( \(in the compile cache\))?\)$", decided)
    proc = run(
        "train", "CartPole-v1", "--out", str(tmp_path / "off"), "--set", "ppo.compile=off",
        "--set", "total_env_steps=2048", "--set", "eval_every_steps=2048",
    )  # fmt: skip
    assert "trainer: OnPolicyTrainer, eager (compile: off)" in proc.stderr


def test_unknown_env_lists_known_names_without_traceback(tmp_path):
    proc = run("train", "NoSuchEnv-v0", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2
    assert "unknown env 'NoSuchEnv-v0'" in proc.stderr
    assert "CartPole-v1" in proc.stderr and "Pendulum-v1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_unknown_env_is_answered_before_torch_is_imported(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "services.cli", "train", "NoSuchEnv-v0"],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "PODIUM_POD_MALLOC": "system"},
    )  # fmt: skip
    assert proc.returncode == 2 and "unknown env 'NoSuchEnv-v0'" in proc.stderr
    imported = [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if "|" in line]
    assert "services.cli.train" in imported and "torch" not in imported


def test_an_eager_run_never_imports_the_compiler(tmp_path):
    """A run that trains eagerly (``auto`` on a short run) imports no torch._dynamo: not for
    the decision, nor to find torch's default compile cache (no TORCHINDUCTOR_CACHE_DIR)."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "services.cli", "train", "CartPole-v1",
         "--out", str(tmp_path / "run"), "--set", "total_env_steps=2048", "--quiet"],
        capture_output=True, text=True, timeout=300, check=False,
        env={**env, "PODIUM_POD_MALLOC": "system", "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if "|" in line]
    assert "services.pod.training.fit" in imported and "torch._dynamo" not in imported


def test_invalid_fields_are_named(tmp_path):
    proc = run(
        "train", "CartPole-v1", "--set", "ppo.lr=3", "--set", "ppo.gamma=1.5",
        "--out", str(tmp_path / "x"),
    )  # fmt: skip
    assert proc.returncode == 2
    assert "ppo.lr: Extra inputs are not permitted" in proc.stderr
    assert "ppo.gamma" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_setting_in_the_wrong_place_says_where_it_is(tmp_path):
    """``sac.compile`` is the off-policy loop's top-level ``compile``; a top-level
    ``learning_rate`` is the algorithm's; another algorithm's section would be ignored."""
    cases = {
        ("--set", "algorithm=sac", "--set", "sac.compile=on"): [
            "sac.compile: Extra inputs are not permitted",
            "(compile is set as compile)",
        ],
        ("--set", "algorithm=td3", "--set", "learning_rate=0.001"): [
            "(learning_rate is set as td3.learning_rate)",
        ],
        ("--set", "algorithm=td3", "--set", "sac.tau=0.1"): [
            "sac: this run trains td3 (`algorithm`): sac's settings would not apply",
        ],
    }
    for args, lines in cases.items():
        proc = run("train", "Pendulum-v1", *args, "--quiet", "--out", str(tmp_path / "x"))
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        for line in lines:
            assert line in proc.stderr, (args, proc.stderr)
        assert "sac.learning_rate" not in proc.stderr  # only the trained algorithm's section
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "x").exists()


def test_a_target_no_episode_can_reach_is_refused(tmp_path):
    """Pendulum's returns are never positive: a target of 200 (for -200) trained the whole
    budget without a word; a spec with one ran to its budget, or for ever without one."""
    proc = run("train", "Pendulum-v1", "--set", "target_return=200", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "target_return 200 is above the best return an episode of Pendulum-v1" in proc.stderr
    assert "(did you mean -200?)" in proc.stderr and "Traceback" not in proc.stderr
    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\nenv: {name: Pendulum-v1}\nalgorithms: {sac: 1.0}\n"
                    "target_return: 200\n")  # fmt: skip
    proc = run("run", str(spec), "--out", str(tmp_path / "y"))
    assert proc.returncode == 2 and "target_return 200 is above" in proc.stderr, proc.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


BRANCHY = """
import gymnasium as gym
import numpy as np
import torch

from services.contracts.envs import EnvCard
from services.pod.envs.base import TorchVecEnv
from services.pod.envs.functional import FunctionalEnv


class Branchy(FunctionalEnv):
    name = "Branchy-v0"
    state_dim = 1
    reset_uniforms = 1

    def __init__(self, device="cpu", dtype=torch.float32, max_episode_steps=50):
        super().__init__(device, dtype, max_episode_steps)
        self.single_observation_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float32)
        self.single_action_space = gym.spaces.Discrete(2)
        self.uniform_start([-1.0], [2.0])

    def step(self, state, action):
        if bool((state > 0).any()):  # a branch on a value: no whole graph to compile
            state = state - 0.1
        reward = -state[..., 0].abs()
        return state, reward, torch.zeros_like(reward, dtype=torch.bool)


class BranchyEnv(TorchVecEnv):
    functional = Branchy


NOT_ITS_CARD = EnvCard("Other-v0", "discrete")
"""


def test_a_broken_plugin_is_one_line_naming_it(tmp_path, monkeypatch):
    """Each was a traceback: an env whose module does not import, a card registered under
    another env's name, and ``compile: on`` of a step dynamo cannot capture whole (which
    docs/compiled-loop.md says `podium train` refuses with the reason)."""
    from tests.pod.plugins import register_plugin

    envs = {"Branchy-v0": "podium_cli_plugin:BranchyEnv", "Broken-v0": "podium_no_such_module:Env",
            "Mismatch-v0": "podium_cli_plugin:BranchyEnv"}  # fmt: skip
    cards = {"Mismatch-v0": "podium_cli_plugin:NOT_ITS_CARD"}
    groups = {"podium.envs": envs, "podium.env_cards": cards}
    register_plugin(tmp_path, monkeypatch, "podium_cli_plugin", BRANCHY, groups)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    cases = {
        ("Broken-v0",): "env 'Broken-v0' (registered as podium_no_such_module:Env in "
        "podium.envs) cannot be loaded: ModuleNotFoundError",
        ("Mismatch-v0",): "the env card registered as 'Mismatch-v0' is not an EnvCard named "
        "'Mismatch-v0' (named 'Other-v0')",
        ("Branchy-v0", "--set", "ppo.compile=on"): "compile: on cannot be honoured here",
        # Not a plugin: an env whose extra is not installed here (a traceback too).
        ("Isaac-Ant-v0",): "Isaac Lab is not installed",
    }
    for args, message in cases.items():
        proc = subprocess.run(
            [*PODIUM, "train", *args, "--set", "total_env_steps=2048", "--quiet",
             "--out", str(tmp_path / "out")],
            capture_output=True, text=True, timeout=300, env=env, check=False,
        )  # fmt: skip
        assert proc.returncode == 2, (args, proc.stderr[-3000:])
        assert message in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)


def test_env_arguments_are_checked_as_a_spec_s_are(tmp_path):
    """They were raw errors from deep inside (``make_env() got multiple values for argument
    'num_envs'``) where a spec's are refused naming the field."""
    cases = {
        ("StockTrading-v0", "env_kwargs.num_envs=4"): "env_kwargs: num_envs is set by the run",
        ("CartPole-v1", "env_kwargs.seed=3"): "env_kwargs: seed is set by the run",
        ("CartPole-v1", "eval_env_kwargs.max_episode_step=9"): "eval_env_kwargs: CartPole-v1 "
        "does not take 'max_episode_step' (did you mean 'max_episode_steps'?)",
    }
    for (env, setting), message in cases.items():
        proc = run("train", env, "--set", setting, "--quiet", "--out", str(tmp_path / "x"))
        assert proc.returncode == 2, (setting, proc.stderr[-2000:])
        assert message in proc.stderr and "Traceback" not in proc.stderr, (setting, proc.stderr)
    assert not (tmp_path / "x").exists()


def test_an_unusable_output_path_is_one_line_naming_the_option(tmp_path):
    """Refused before anything starts, exit 2, no traceback (each was a traceback: a file as
    --out, a --data-dir that cannot be made, a port past 65535)."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    spec = str(Path(__file__).resolve().parents[1] / "examples" / "cartpole.yaml")
    cases = {
        ("train", "CartPole-v1", "--out", str(afile)): f"--out {afile}: exists and is not a dir",
        ("train", "CartPole-v1", "--out", str(afile / "x")): "--out",
        ("run", spec, "--out", str(afile)): f"--out {afile}: exists and is not a directory",
        ("run", spec, "--data-dir", str(afile / "data")): "--data-dir",
        ("compile", spec, "--out", str(afile)): f"--out {afile}: exists and is not a directory",
        ("run", spec, "--port", "99999"): "--port",
    }
    for args, message in cases.items():
        proc = run(*args)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert message in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)
    assert afile.read_text() == "mine"


def test_a_pod_larger_than_this_machine_is_refused_before_the_platform_starts(tmp_path):
    """The embedded platform's capacity does not grow: such a run waited, pending, until
    killed, with only `pending pods 0` on the screen."""
    spec = tmp_path / "big.yaml"
    spec.write_text("name: big\nenv: {name: CartPole-v1}\nalgorithms: {ppo: 1.0}\n"
                    "resources: {gpus: 1}\n")  # fmt: skip
    env = {**os.environ, "PODIUM_CAPACITY_GPUS": "0"}
    for command in ("run", "compile"):
        proc = subprocess.run(
            [*PODIUM, command, str(spec), "--out", str(tmp_path / command)],
            capture_output=True, text=True, timeout=300, env=env, check=False,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "resources.gpus: each pod asks 1, this machine has 0" in proc.stderr, proc.stderr
        assert not (tmp_path / command / "data" / "podium.log").exists()  # nothing started


def test_ids_and_places_that_cannot_be_an_experiment_s_are_named(tmp_path):
    """An id that is no id (it was sent as a URL path: the error blamed the URL), a negative
    count, a file where a directory belongs, and a --data-dir with no logs and no
    orchestrator: each says what is wrong."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    nowhere = ["--url", "http://127.0.0.1:9"]
    cases = {
        ("status", "../../etc", *nowhere): (2, "'../../etc' is not an experiment id"),
        ("logs", "abc", "../p", *nowhere): (2, "'../p' is not a pod id"),
        ("status", "abc", "--events", "-1", *nowhere): (2, "--events"),
        ("backtest", str(afile)): (2, f"{afile}: not a directory"),
        ("logs", "abc123", "--data-dir", str(tmp_path / "none"), *nowhere): (
            3, f"no pod logs under {tmp_path / 'none'}/experiments/abc123/pods; cannot reach"
        ),
    }  # fmt: skip
    for args, (code, message) in cases.items():
        proc = run(*args)
        assert proc.returncode == code, (args, proc.stderr[-2000:])
        assert message in " ".join(proc.stderr.replace("│", " ").split()), (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_bad_config_file_and_bad_set_syntax(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("ppo: [unclosed\n")
    proc = run("train", "CartPole-v1", "--config", str(bad), "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "not valid YAML" in proc.stderr
    proc = run("train", "CartPole-v1", "--set", "novalue", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "key=value" in proc.stderr
    proc = run("train", "CartPole-v1", "--config", str(tmp_path / "missing.yaml"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a GPU where there is none")
def test_a_device_this_machine_lacks_is_a_named_error(tmp_path):
    proc = run("train", "CartPole-v1", "--set", "device=cuda", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2
    assert "device: Value error, 'cuda': torch sees no CUDA device" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run("train", "CartPole-v1", "--set", "device=gpu0", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2
    assert "'gpu0' is not a torch device" in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_env_kwarg_is_refused(tmp_path):
    proc = run("train", "CartPole-v1", "--set", "env_kwargs.gravity=3", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert "'gravity'" in proc.stderr and "Traceback" not in proc.stderr


def test_train_an_off_policy_agent(tmp_path):
    out = tmp_path / "sac"
    proc = run(
        "train", "Pendulum-v1", "--set", "algorithm=sac", "--set", "total_env_steps=2048",
        "--set", "eval_every_steps=1024", "--set", "learning_starts=256",
        "--out", str(out), "--quiet",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    files = read_files(out / "checkpoints" / "latest")
    assert files.manifest["algorithm"] == "sac"
    assert "replay_buffer" in files.tensors
    assert (out / "learning_curve.png").read_bytes().startswith(b"\x89PNG")
    bad = run("train", "Pendulum-v1", "--set", "algorithm=sac", "--set", "sac.lr=1")
    assert bad.returncode == 2 and "sac.lr" in bad.stderr and "Traceback" not in bad.stderr


# -- bad spec files and options: a message and exit code 2 (docs/tournaments.md), no traceback ----
SPEC = "name: x\nenv: {name: CartPole-v1}\nalgorithms: {ppo: 1}\n"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"name: caf\xe9\n" + SPEC.encode(), "not UTF-8 text"),
        (SPEC.encode() + b"target_return: .nan\n", "target_return: must be a finite number"),
        (SPEC.encode() + b"round: {seconds: .inf}\n", "round.seconds: must be a finite number"),
        (
            b"name: x\nenv: {name: CartPole-v1, kwargs: {x: -.inf}}\nalgorithms: {ppo: 1}\n",
            "env.kwargs.x: must be a finite number",
        ),
    ],
)
@pytest.mark.parametrize("command", ["submit", "run"])
def test_spec_files_json_cannot_carry_are_refused(tmp_path, command, content, message):
    spec = tmp_path / "spec.yaml"
    spec.write_bytes(content)
    # Refused before any service is asked (none listens on port 9).
    url = ["--url", "http://127.0.0.1:9"] if command == "submit" else []
    proc = run(command, str(spec), *url, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--timeout", "-5", "must be a number of seconds > 0"),
        ("--timeout", "0", "must be a number of seconds > 0"),
        ("--timeout", "nan", "must be a number of seconds > 0"),
        ("--min-reward", "inf", "must be a finite number"),
    ],
)
def test_bad_waiting_options_are_usage_errors(tmp_path, option, value, message):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    proc = run("submit", str(spec), option, value, "--url", "http://127.0.0.1:9")
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    if option == "--timeout":
        proc = run("run", str(spec), option, value, cwd=tmp_path)
        assert proc.returncode == 2 and message in proc.stderr
        assert not (tmp_path / "runs").exists()  # refused before the platform started


def test_a_config_file_that_is_not_utf8_is_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"ppo:\n  learning_rate: 1e-3 # caf\xe9\n")
    proc = run("train", "CartPole-v1", "--config", str(bad), "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "not UTF-8 text" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- podium backtest: a trading agent's files against the baselines, held out ------------------
def train_agent(out: Path, env: str, *sets: str) -> Path:
    """``podium train ENV`` of 2,048 env steps (and ``sets``) into ``out``; its checkpoints."""
    overrides = ["total_env_steps=2048", "eval_every_steps=1024", *sets]
    proc = run("train", env, "--out", str(out), "--quiet", *(f"--set={o}" for o in overrides))
    assert proc.returncode == 0, proc.stderr
    return out / "checkpoints"


def assert_refused(proc: subprocess.CompletedProcess, message: str) -> None:
    """A usage error: exit 2, ``message`` on stderr, no traceback."""
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def trader(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A StockTrading-v0 agent's checkpoints, trained once for the backtest tests."""
    out = tmp_path_factory.mktemp("trader")
    return train_agent(out, "StockTrading-v0", "env_kwargs.regime=crash", "ppo.num_envs=4")


def test_backtest_a_trained_trading_agent(tmp_path, trader):
    """The user's path after training on StockTrading-v0: the agent's verified files run over
    the held-out period beside buy-and-hold and equal weight; the agent's Sharpe is the one
    its env's own evaluation reports (``score="sharpe"``), buy-and-hold's the baseline's."""
    from services.pod.roles.evaluator import evaluate_groups
    from services.pod.trading.backtest import buy_and_hold, load_policy
    from services.pod.trading.env import StockTradingEnv

    files, png = trader / "best", tmp_path / "values.png"
    proc = run("backtest", str(files), "--json", "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["period"] == "backtest" and set(report["metrics"]) == {
        "agent", "buy-and-hold", "equal weight",
    }  # fmt: skip
    assert png.read_bytes().startswith(b"\x89PNG")

    config, policy = load_policy(files)
    for name, tensor in read_files(files).tensors["actor"].items():  # the trained weights
        assert torch.equal(policy.state_dict()[name], tensor), name
    env = StockTradingEnv(1, mode="backtest", score="sharpe", **config.env_kwargs)
    [own] = evaluate_groups(env, policy.act_deterministic)
    assert report["metrics"]["agent"]["sharpe"] == pytest.approx(own.mean, rel=1e-5)
    held = buy_and_hold(env.data.close, env.initial_amount, env.transaction_cost)
    assert report["metrics"]["buy-and-hold"]["cumulative_return"] == pytest.approx(
        held[-1] / held[0] - 1
    )

    table = run("backtest", str(files), "--period", "validation")
    assert table.returncode == 0, table.stderr
    assert "validation period" in table.stdout and "buy-and-hold" in table.stdout


def test_train_and_backtest_a_portfolio_gradient_agent(tmp_path):
    """``podium train StockTrading-v0 --set algorithm=portfolio_gradient``: its preset (a step
    reads the 1,512 train days, so 2,048 env steps are two steps), files a backtest runs."""
    sets = ["total_env_steps=2048", "eval_every_steps=1024", "algorithm=portfolio_gradient"]
    proc = run("train", "StockTrading-v0", "--out", str(tmp_path), *(f"--set={o}" for o in sets))
    assert proc.returncode == 0, proc.stderr
    # Its preset scores the validation period by the Sharpe ratio: said so, not "return 0.5".
    assert re.search(r"best eval sharpe -?\d+\.\d{3} after", proc.stderr), proc.stderr
    files = tmp_path / "checkpoints" / "best"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["env_steps"], r["updates"]) for r in records] == [(1512, 1), (3024, 2)]
    assert "eval_return" in records[-1] and "train_sharpe" in records[-1]
    proc = run("backtest", str(files), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["period"] == "backtest" and report["metrics"]["agent"]["days"] > 400
    assert read_files(files).manifest["algorithm"] == "portfolio_gradient"


def test_backtest_refuses_what_it_cannot_run(tmp_path, trader):
    from services.pod.training.checkpoint import write_files

    cartpole = train_agent(tmp_path / "cartpole", "CartPole-v1") / "latest"
    tampered = shutil.copytree(cartpole, tmp_path / "tampered")
    (tampered / "actor.safetensors").write_bytes(b"\0" * 64)
    cases = [
        (cartpole, "trained on CartPole-v1; a backtest needs StockTrading-v0"),
        (tmp_path / "nowhere", "no such directory"),
        (tampered, "actor.safetensors"),
    ]
    # Files from another version, complete and verified: env arguments this env does not
    # take, a config field this Podium does not know.
    good = trader / "latest"
    raw = {f.name: f.read_bytes() for f in good.iterdir() if f.name != "manifest.json"}
    hyper = read_files(good).documents["hyperparameters"]
    edits = [
        ({"env_kwargs": {**hyper["env_kwargs"], "bogus": 1}}, "'bogus'"),
        ({"learning_rate_of_old": 1}, "learning_rate_of_old"),
    ]
    for k, (edit, message) in enumerate(edits):
        other = tmp_path / f"other{k}"
        files = {**raw, "hyperparameters.json": json.dumps({**hyper, **edit}).encode()}
        write_files(other, files, {"algorithm": "ppo"})
        cases.append((other, message))
    for directory, message in cases:
        assert_refused(run("backtest", str(directory)), message)
    (tmp_path / "taken.png").mkdir()
    for args, message in [
        (["--period", "train"], "'train' is not one of"),
        (["--plot", str(tmp_path / "x.txt")], "a .png file"),
        (["--plot", str(tmp_path / "taken.png")], "taken.png"),  # a directory
    ]:
        assert_refused(run("backtest", str(good), *args), message)


def test_every_commands_help_reads_as_flowing_text():
    """`podium --help` lists each command by a one-line summary, and `podium CMD --help` shows
    its help's paragraphs as flowing text: typer keeps a docstring's line breaks, which broke
    the listing and each help page mid-sentence (`run`, `compile`, `logs`, `tensorboard`)."""
    import typer
    from typer.testing import CliRunner

    from services.cli.app import app

    runner = CliRunner(env={"COLUMNS": "400"})
    listing = runner.invoke(app, ["--help"]).output
    for name, command in typer.main.get_command(app).commands.items():
        summary, *details = (command.help or "").split("\n\n")
        assert summary and "\n" not in summary, (name, summary)
        assert summary in listing, (name, summary)
        shown = runner.invoke(app, [name, "--help"]).output
        for paragraph in details:
            assert " ".join(paragraph.split()) in shown, (name, paragraph)


def test_a_preformatted_paragraph_keeps_its_lines():
    import typer

    from services.cli.app import flowing_help

    app = typer.Typer()

    @app.command()
    def one() -> None:
        """Summary
        over two lines.

        \b
        a   b
        c   d
        """

    flowing_help(app)
    assert app.registered_commands[0].help == "Summary over two lines.\n\n\b\na   b\nc   d"
