"""TensorBoard event files, read back as TensorBoard reads them: `podium train`'s under its
--out, a pod's under the directory it is given (services/pod/training/tensorboard.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from services.contracts.spec import ExperimentSpec
from services.pod.runtime.rounds import PodRuntime, RuntimeSettings
from services.pod.training.tensorboard import Board
from tests.pod.harness import ROOT, Leaderboard, client, make_spec, register, start_pod

pytestmark = pytest.mark.timeout(300)


def read(log_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def steps(events: EventAccumulator, tag: str) -> list[int]:
    return [e.step for e in events.Scalars(tag)]


def values(events: EventAccumulator, tag: str) -> list[float]:
    return [e.value for e in events.Scalars(tag)]


def hyperparameter_table(events: EventAccumulator) -> str:
    [first, *_] = events.Tensors("hyperparameters/text_summary")
    return tensor_util.make_ndarray(first.tensor_proto).item().decode()


def podium_train(out: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable, "-m", "services.cli", "train", "CartPole-v1", "--out", str(out),
            "--quiet", "--set", "total_env_steps=2048", "--set", "eval_every_steps=512",
            "--set", "eval_episodes=2",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_podium_train_writes_its_curves_and_hyperparameters(tmp_path: Path) -> None:
    """Every evaluation of metrics.jsonl is a point of eval/return at its env steps; the
    trainer's statistics, its return and its rate are curves too; the config is the run's
    hyperparameters. A rerun into the same --out replaces the curves (as it does
    metrics.jsonl) instead of drawing a second run over the first."""
    out = tmp_path / "run"
    podium_train(out)
    podium_train(out)
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in records if "eval_return" in r]

    events = read(out / "tensorboard")
    scalars = set(events.Tags()["scalars"])
    assert {"eval/return", "eval/return_std", "train/return", "perf/env_steps_per_s"} <= scalars
    assert {"losses/pg_loss", "losses/v_loss", "train/entropy"} <= scalars
    assert steps(events, "eval/return") == [512, 1024, 1536, 2048]
    assert steps(events, "eval/return") == [r["env_steps"] for r in evaluations]
    assert values(events, "eval/return") == pytest.approx([r["eval_return"] for r in evaluations])
    assert all(v > 0 for v in values(events, "perf/env_steps_per_s"))
    assert set(steps(events, "train/return")) <= {r["env_steps"] for r in records}
    table = hyperparameter_table(events)
    assert "| algorithm | ppo |" in table and "| total_env_steps | 2048 |" in table
    assert "| ppo.learning_rate |" in table
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")


def test_a_pod_process_writes_its_curves_under_the_directory_it_is_given(
    leaderboard: Leaderboard, tmp_path: Path
) -> None:
    """``PODIUM_TENSORBOARD_DIR``: each report's score is a point of eval/return at the env
    steps the pod had trained, each round a point of its training curves."""
    spec = make_spec()
    register(leaderboard, "tb", spec)
    board_dir = tmp_path / "tensorboard" / "tb" / "p0"
    proc = start_pod(
        leaderboard, "tb", "p0", spec, tmp_path, tmp_path / "pod.log",
        PODIUM_MAX_ENV_STEPS="2500", PODIUM_TENSORBOARD_DIR=str(board_dir),
    )  # fmt: skip
    try:
        assert proc.wait(timeout=180) == 0, (tmp_path / "pod.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [json.loads(line) for line in (tmp_path / "pod.log").read_text().splitlines()]
    reports = [line for line in lines if line["event"] == "reported"]
    trained = 0
    report_steps = []
    for report in reports:
        trained += report["env_steps"]
        report_steps.append(trained)

    events = read(board_dir)
    assert steps(events, "eval/return") == report_steps == [1024, 2048, 2304]
    assert values(events, "eval/return") == pytest.approx([r["score"] for r in reports])
    assert steps(events, "losses/pg_loss") == [1024, 2048, 2304]  # a point per round
    # The training return only for rounds whose last rollout ended an episode (the trainer's
    # progress is its last update's; once the agent balances for long, one can end none).
    assert set(steps(events, "train/return")) <= {1024, 2048, 2304}
    assert steps(events, "train/return")[:1] == [1024]  # the first round's short episodes
    assert {"losses/pg_loss", "perf/env_steps_per_s"} <= set(events.Tags()["scalars"])
    assert "| algorithm | ppo |" in hyperparameter_table(events)
    assert "| learning_rate |" in hyperparameter_table(events)


def test_a_population_pod_writes_a_run_per_agent(leaderboard: Leaderboard, tmp_path: Path) -> None:
    """Each agent's evaluations and hyperparameters in ``m<i>/``, the pod's training curves
    (its agents' statistics averaged) beside them."""
    spec = make_spec(population={"min_pods": 1, "max_pods": 1, "agents_per_pod": 2})
    register(leaderboard, "tb-pop", spec)
    settings = RuntimeSettings(
        work_dir=tmp_path / "p0", grace_s=10, max_env_steps=2500, tensorboard_dir=tmp_path / "tb"
    )
    model = ExperimentSpec.model_validate(spec)
    rt = PodRuntime("tb-pop", "p0", model, client(leaderboard, "tb-pop"), settings)
    rt.run()  # returns by itself once the budget is spent: one round of 1,024 steps per agent
    rt.close()
    pod = read(tmp_path / "tb")
    assert steps(pod, "train/return") == [1024]
    assert "eval/return" not in pod.Tags()["scalars"]
    for i in range(2):
        agent = read(tmp_path / "tb" / f"m{i}")
        assert steps(agent, "eval/return") == [1024]
        assert values(agent, "eval/return") == pytest.approx([rt.slots[i].score])
        rate = rt.slots[i].hyperparameters["learning_rate"]
        assert f"| learning_rate | {rate} |" in hyperparameter_table(agent)


def test_a_writer_that_cannot_write_logs_once_and_training_goes_on(tmp_path: Path) -> None:
    """A board whose directory cannot be made (a file is in the way), and one whose event file
    is closed under it mid-run: no call raises, each logs one warning, later calls are
    dropped."""
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    broken = Board(blocked / "tensorboard")
    with capture_logs() as logs:
        for step in range(3):
            broken.record({"env_steps": step, "train_seconds": 1.0 + step, "eval_return": 1.0})
        broken.hyperparameters({"lr": 0.1})
        broken.close()
    assert [entry["event"] for entry in logs] == [
        "tensorboard writer failed; training goes on without it"
    ]
    assert not broken.enabled

    board = Board(tmp_path / "ok", min_interval_s=0.0)
    board.record({"env_steps": 1, "train_seconds": 1.0, "eval_return": 5.0})
    board._writer.file_writer.event_writer.close()  # the event file goes away under it
    with capture_logs() as logs:
        for step in range(2, 5):
            board.record({"env_steps": step, "train_seconds": float(step), "eval_return": 5.0})
        board.flush()
        board.close()
    assert len(logs) == 1 and logs[0]["log_level"] == "warning"
    assert steps(read(tmp_path / "ok"), "eval/return") == [1]


def test_podium_train_trains_on_when_its_tensorboard_dir_cannot_be_made(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").write_text("a file where the directory would go")
    podium_train(out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["env_steps"] for r in records if "eval_return" in r] == [512, 1024, 1536, 2048]


def test_the_local_backend_gives_each_pod_a_tensorboard_dir_in_its_data_dir(
    tmp_path: Path,
) -> None:
    """``<data dir>/tensorboard/<experiment>/<pod>``: `tensorboard --logdir <data
    dir>/tensorboard` shows every pod of every experiment, one run each."""
    from services.orchestrator.backends.base import PodRequest
    from services.orchestrator.backends.local import LocalBackend
    from services.orchestrator.scheduler import Res
    from services.orchestrator.settings import OrchestratorSettings

    out = tmp_path / "pod-env.json"
    dump_env = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"
    settings = OrchestratorSettings(
        data_dir=tmp_path / "data",
        backend="local",
        pod_launcher=False,
        pod_command=[sys.executable, "-c", dump_env, str(out)],
    )
    backend = LocalBackend(settings)
    try:
        backend.create_pod(PodRequest("e1", "p1", '{"name": "e1"}', Res(1, 0, 1 << 30), {}))
        deadline = time.monotonic() + 60
        while True:
            try:
                env = json.loads(out.read_text())
                break
            except (OSError, ValueError):  # not written yet, or half written
                assert time.monotonic() < deadline, "the pod wrote no environment"
                time.sleep(0.05)
    finally:
        backend.close()
    expected = (tmp_path / "data").resolve() / "tensorboard" / "e1" / "p1"
    assert Path(env["PODIUM_TENSORBOARD_DIR"]).resolve() == expected


def test_a_curve_only_some_records_hold_is_written_though_records_are_thinned(
    tmp_path: Path,
) -> None:
    """Records closer together than the write interval were dropped whole, and with them the
    train/return of Pendulum and Acrobot (held only by the records where episodes ended)."""
    board = Board(tmp_path, min_interval_s=60.0)
    board.record({"env_steps": 100, "train_seconds": 0.1, "entropy": 1.0})  # written
    for n in range(200, 1000, 100):  # thinned out: within the interval
        ended = {"train_return": -float(n)} if n == 500 else {}
        board.record({"env_steps": n, "train_seconds": n / 1000, "entropy": 0.5, **ended})
    board.record({"env_steps": 1000, "train_seconds": 1.0, "eval_return": -150.0})  # written
    board.record({"env_steps": 1100, "train_seconds": 1.1, "train_return": -120.0})  # held
    board.close()
    events = read(tmp_path)
    assert values(events, "train/return") == [-500.0, -120.0]
    assert steps(events, "train/return") == [1000, 1100]
    assert values(events, "train/entropy") == [1.0, 0.5]
