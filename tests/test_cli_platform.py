"""The platform commands as a user runs them: `podium` subprocesses against the real embedded
platform (real Redis, real leaderboard and orchestrator over HTTP, real pod processes).

Pods are the orchestrator's stand-in pod (tests/orchestrator/standin_pod.py), configured by the
spec's env.kwargs.standin, except in the slow test at the end, which trains CartPole for real.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml
from pydantic import ValidationError

from services import malloc, redis_client
from services.cli.platform import EMBEDDED_PACE, Platform, read_session

ROOT = Path(__file__).resolve().parents[1]
PODIUM = [sys.executable, "-m", "services.cli"]
STANDIN = str(ROOT / "tests" / "orchestrator" / "standin_pod.py")
POD_COMMAND = [sys.executable, STANDIN, "{experiment_id}", "{pod_id}"]
# Fast reconciling for tests; everything else is the embedded platform's defaults.
FAST = {
    "reconcile_interval_s": 0.1,
    "progress_poll_s": 0.1,
    "termination_grace_s": 3.0,
    "backoff_initial_s": 0.05,
    "backoff_max_s": 0.2,
    "crash_loop_limit": 2,
    "capacity_cpu": 8,
    "capacity_gpus": 0,
    "capacity_memory": "16Gi",
}


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any PODIUM_* / REDIS_URL the developer has set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODIUM_") and k != "REDIS_URL"}
    env.update(extra)
    return env


def podium(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> Any:
    return subprocess.run(
        [*PODIUM, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env or clean_env(PODIUM_DATA_DIR="/nonexistent-podium-data"),
        check=False,
    )


def spec(name: str = "t", target: float | None = 50.0, **standin: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": name,
        # gymnasium's id: its card lists no arguments, so the stand-in's are not refused.
        "env": {"name": "gym:CartPole-v1", "kwargs": {"standin": standin}},
        "algorithms": {"ppo": 1.0},
        "population": {"min_pods": 1, "max_pods": 1},
        "resources": {"cpu": 1, "gpus": 0, "memory": "1Gi"},
        "round": {"env_steps": 1000},
        "budget": {"wall_time_s": 120},
    }
    if target is not None:
        out["target_return"] = target
    return out


def write_spec(tmp_path: Path, body: dict[str, Any], name: str = "spec.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(body))
    return str(path)


def no_traceback(proc: Any) -> None:
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    data = tmp_path_factory.mktemp("platform")
    overrides = {**FAST, "pod_command": POD_COMMAND}
    with Platform(
        data_dir=data, orchestrator_port=0, leaderboard_port=0, orchestrator_overrides=overrides
    ) as p:
        yield p


@pytest.fixture
def cli(platform: Platform) -> Any:
    """`podium` against the module's platform, by explicit URL and token (as against a cluster)."""
    base = [
        "--url",
        platform.orchestrator_url,
        "--token",
        str(platform.token),
        "--leaderboard-url",
        platform.leaderboard_url,
    ]

    def call(command: str, *args: str, leaderboard: bool = True, timeout: float = 60) -> Any:
        opts = base if leaderboard else base[:4]
        return podium(command, *args, *opts, timeout=timeout)

    return call


def api(platform: Platform, which: str = "orchestrator") -> httpx.Client:
    url = platform.orchestrator_url if which == "orchestrator" else platform.leaderboard_url
    return httpx.Client(
        base_url=f"{url}/api/v1", headers={"Authorization": f"Bearer {platform.token}"}
    )


def wait_for(fn: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := fn():
            return value
        time.sleep(0.1)
    raise AssertionError(f"not met within {timeout}s")


# -- the CI/CD gate ------------------------------------------------------------------------------


def test_gate_passes_when_the_best_score_reaches_min_reward(cli: Any, tmp_path: Path) -> None:
    body = spec(report_interval_s=0.1, score_step=10.0, env_steps_per_report=500)
    proc = cli("submit", write_spec(tmp_path, body), "--min-reward", "40", "--timeout", "60")
    assert proc.returncode == 0, proc.stderr
    exp_id = proc.stdout.strip()
    assert len(exp_id) == 12  # the id alone on stdout, for scripts
    assert ">= min reward 40" in proc.stderr and "target return 50 reached" in proc.stderr
    status = json.loads(cli("status", exp_id, "--json", leaderboard=False).stdout)
    assert status["state"] == "succeeded" and status["result"]["best"]["score"] >= 50
    # Nothing left to cancel: said so, exit 0 (it was exit 3, "API error", from the API's 409).
    late = cli("cancel", exp_id, leaderboard=False)
    assert late.returncode == 0 and f"experiment {exp_id}: succeeded" in late.stderr, late.stderr


def test_gate_fails_when_the_experiment_ends_below_min_reward(cli: Any, tmp_path: Path) -> None:
    body = spec(target=30.0, report_interval_s=0.1, score_step=10.0)
    proc = cli("submit", write_spec(tmp_path, body), "--min-reward", "1000", "--timeout", "60")
    assert proc.returncode == 1, proc.stderr
    assert "< min reward 1000" in proc.stderr and "succeeded" in proc.stderr
    no_traceback(proc)


def test_gate_fails_when_the_experiment_fails(cli: Any, tmp_path: Path) -> None:
    body = spec(crash_after_s=0.2)  # every pod crashes: crash loop -> failed
    proc = cli("submit", write_spec(tmp_path, body), "--min-reward", "1", "--timeout", "60")
    assert proc.returncode == 1, proc.stderr
    assert "experiment failed: pods keep crashing" in proc.stderr
    assert "out of memory" in proc.stderr  # the pod's last log line, as the orchestrator has it
    no_traceback(proc)


def test_gate_times_out_and_cancels(cli: Any, tmp_path: Path, platform: Platform) -> None:
    body = spec()  # the pod never reports: the target is never reached
    proc = cli("submit", write_spec(tmp_path, body), "--min-reward", "1", "--timeout", "1.5")
    assert proc.returncode == 4, proc.stderr
    assert "timed out after 1.5s" in proc.stderr and "cancelled it" in proc.stderr
    exp_id = proc.stdout.strip()
    with api(platform) as c:
        wait_for(lambda: c.get(f"/experiments/{exp_id}").json()["state"] == "cancelled")


def test_wait_without_min_reward_passes_at_the_budget_when_there_is_no_target(
    cli: Any, tmp_path: Path
) -> None:
    body = spec(target=None, report_interval_s=0.1, score_step=1.0, env_steps_per_report=1000)
    body["budget"] = {"total_env_steps": 3000}
    proc = cli("submit", write_spec(tmp_path, body), "--wait", "--timeout", "60")
    assert proc.returncode == 0, proc.stderr
    assert "finished: env-step budget spent" in proc.stderr


def test_live_panel_follows_the_experiment_to_its_end(platform: Platform) -> None:
    """The terminal view of `run` / `submit --wait`: rich Live, fed by real polling."""
    import io

    from rich.console import Console

    from services.cli.client import PodiumClient, resolve
    from services.cli.live import Watch, wait_for_end

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=140, color_system=None)
    ends = resolve(platform.orchestrator_url, platform.token, platform.leaderboard_url)
    with PodiumClient(ends) as client:
        exp = client.submit(spec(report_interval_s=0.2, score_step=10.0, env_steps_per_report=500))
        watch = Watch(client, exp["id"], console, top=3)
        final = wait_for_end(watch, timeout=60, live=True)
    assert final["state"] == "succeeded" and final["result"] is not None
    text = screen.getvalue()
    assert f"t ({exp['id']})" in text and "succeeded" in text
    assert "/ target 50" in text and "env steps/s" in text and "1 running" in text
    assert "leaderboard" in text and final["result"]["best"]["candidate_id"] in text
    bests = [s["best"] for s in watch.samples if s["best"] is not None]
    assert bests == sorted(bests) and bests[-1] >= 50  # the best score only ever rises


def test_live_panel_shows_each_algorithms_pods(platform: Platform) -> None:
    """An ensemble's pods, counted by the algorithm the orchestrator gave each."""
    import io

    from rich.console import Console

    from services.cli.client import PodiumClient, resolve
    from services.cli.live import Watch

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=140, color_system=None)
    ends = resolve(platform.orchestrator_url, platform.token, platform.leaderboard_url)
    body = spec("ens", report_interval_s=0.2, score_step=1.0, env_steps_per_report=100)
    body.update(algorithms={"ppo": 1.0, "dqn": 1.0}, population={"min_pods": 2, "max_pods": 2})
    with PodiumClient(ends) as client:
        exp = client.submit(body)
        try:
            watch = Watch(client, exp["id"], console, top=3)
            running = wait_for(
                lambda: (
                    (e := watch.poll())
                    and sum(p["phase"] == "Running" for p in e["pods"]) == 2
                    and e
                )
            )
            assert sorted(p["algorithm"] for p in running["pods"]) == ["dqn", "ppo"]
            console.print(watch.render(running))
        finally:
            client.cancel(exp["id"])
    assert "2 running (1 dqn, 1 ppo)" in screen.getvalue()


def test_the_live_view_says_what_the_pods_say_they_do(platform: Platform) -> None:
    """The pods' own ``pod activity`` records, read from their logs through the orchestrator:
    in the panel and in CI's lines, with how long the pod has been at it."""
    import io

    from rich.console import Console

    from services.cli.client import PodiumClient, resolve
    from services.cli.live import Watch

    ends = resolve(platform.orchestrator_url, platform.token, platform.leaderboard_url)
    body = spec("doing", target=None, activity="compiling", activity_s=30.0)
    with PodiumClient(ends) as client:
        exp = client.submit(body)
        try:
            watch = Watch(client, exp["id"], Console(file=io.StringIO()), top=0)
            # A pod that has said nothing yet is "starting"; the record comes once its log has it.
            running = wait_for(lambda: (e := watch.poll()) and "compiling" in watch.doing(e) and e)
        finally:
            client.cancel(exp["id"])
    doing = watch.doing(running)
    assert re.fullmatch(r"1 compiling \((\d+) s\)", doing), doing
    assert int(doing.split("(")[1].split()[0]) >= 30  # since the record's time less its seconds
    line = watch.line(running)
    assert line is not None and line.endswith(f"| {doing}"), line


# -- the other commands --------------------------------------------------------------------------


def test_status_leaderboard_export_cancel(cli: Any, tmp_path: Path, platform: Platform) -> None:
    body = spec(target=None, report_interval_s=0.1, score_step=1.0, env_steps_per_report=100)
    proc = cli("submit", write_spec(tmp_path, body, "s.yaml"))
    assert proc.returncode == 0, proc.stderr
    exp_id = proc.stdout.strip()
    with api(platform, "leaderboard") as lb:
        wait_for(lambda: lb.get(f"/experiments/{exp_id}/best").status_code == 200)
        # A pod's report with training files (as the evaluator sends them), best by far.
        files = {"manifest.json": b"", "actor.safetensors": os.urandom(5000)}
        manifest = {
            "format": "podium.training-files/1",
            "files": {
                "actor.safetensors": {
                    "sha256": hashlib.sha256(files["actor.safetensors"]).hexdigest(),
                    "bytes": 5000,
                }
            },
        }
        files["manifest.json"] = json.dumps(manifest).encode()
        result = {
            "submission_id": "with-files",
            "pod_id": "p-files",
            "algorithm": "ppo",
            "score": 1e6,
            "eval": {"mean": 1e6, "std": 0.5, "episodes": 4},
            "env_steps": 10,
            "trained_env_steps": 123_456,
            "files": {n: hashlib.sha256(b).hexdigest() for n, b in files.items()},
        }
        parts: dict[str, Any] = {"result": (None, json.dumps(result), "application/json")}
        parts.update({n: (n, b, "application/octet-stream") for n, b in files.items()})
        r = lb.post(f"/experiments/{exp_id}/submissions", files=parts)
        assert r.status_code == 200 and r.json()["rank"] == 1, r.text

    listed = cli("status", leaderboard=False)
    assert listed.returncode == 0 and exp_id in listed.stdout and "running" in listed.stdout
    one = cli("status", exp_id, leaderboard=False)
    assert one.returncode == 0, one.stderr
    assert "pod_started" in one.stdout and "1 running" in one.stdout

    board = cli("leaderboard", exp_id)
    assert board.returncode == 0, board.stderr
    assert "1e+06" in board.stdout and "p-files" in board.stdout
    assert "123,456" in board.stdout  # the agent's env steps, not its report's 10
    # On an 80-column terminal: the rank and the hyperparameters stay (rich shrank both
    # columns to nothing); what a reader can do without (± std, pod, trained) goes.
    narrow = podium(
        "leaderboard", exp_id, "--url", platform.orchestrator_url, "--token",
        str(platform.token), "--leaderboard-url", platform.leaderboard_url,
        env=clean_env(FORCE_COLOR="1", NO_COLOR="1", COLUMNS="80"),
    )  # fmt: skip
    assert narrow.returncode == 0, narrow.stderr
    text = re.sub(r"\x1b\[[0-9;]*m", "", narrow.stdout)
    rows = [line for line in text.splitlines() if "1e+06" in line]
    assert rows and rows[0].split("│")[1].strip() == "1", text  # the rank
    assert "┃ hyperparameters" in text, text
    assert max(len(line) for line in text.splitlines()) <= 80, text
    top = json.loads(cli("leaderboard", exp_id, "--json", "--top", "1").stdout)
    assert [c["pod_id"] for c in top["candidates"]] == ["p-files"]

    out = tmp_path / "best"
    exported = cli("export", exp_id, "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    assert "2 files verified" in exported.stderr
    for name, data in files.items():
        assert (out / name).read_bytes() == data
    assert json.loads((out / "candidate.json").read_text())["pod_id"] == "p-files"
    # Against a deployment (--url, no session file) export needed --leaderboard-url;
    # the orchestrator says where its leaderboard is.
    found = cli("export", exp_id, "--out", str(tmp_path / "found"), leaderboard=False)
    assert found.returncode == 0, found.stderr
    assert (tmp_path / "found" / "actor.safetensors").read_bytes() == files["actor.safetensors"]
    board_found = cli("leaderboard", exp_id, leaderboard=False)
    assert board_found.returncode == 0 and "p-files" in board_found.stdout, board_found.stderr

    # A blob changed on the server's disk: the export refuses it and leaves the old one intact.
    actor_sha = result["files"]["actor.safetensors"]
    blob = platform.data_dir / "blobs" / actor_sha[:2] / actor_sha[2:4] / actor_sha
    blob.chmod(0o644)
    blob.write_bytes(b"tampered" + files["actor.safetensors"][8:])
    bad = cli("export", exp_id, "--out", str(out))
    assert bad.returncode == 3 and "does not match" in bad.stderr, bad.stderr
    assert (out / "actor.safetensors").read_bytes() == files["actor.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".best")]
    no_traceback(bad)

    stopped = cli("cancel", exp_id, leaderboard=False)
    # The orchestrator may end the cancel before it answers (no pod has a report to make):
    # the command then says the experiment is cancelled, else that the cancel is under way.
    said = ("cancel requested", "cancelled (cancelled by request)")
    assert stopped.returncode == 0 and any(s in stopped.stderr for s in said), stopped.stderr
    with api(platform) as c:
        wait_for(lambda: c.get(f"/experiments/{exp_id}").json()["state"] == "cancelled")
    again = cli("cancel", "no-such-exp", leaderboard=False)
    assert again.returncode == 3 and "experiment 'no-such-exp' not found" in again.stderr


def test_logs_of_the_embedded_platform(cli: Any, tmp_path: Path, platform: Platform) -> None:
    proc = cli("submit", write_spec(tmp_path, spec(target=None)))
    exp_id = proc.stdout.strip()
    with api(platform) as c:
        pods = wait_for(lambda: c.get(f"/experiments/{exp_id}").json()["pods"])
        pod = pods[0]["pod_id"]
        log = platform.data_dir / "experiments" / exp_id / "pods" / f"{pod}.log"
        wait_for(lambda: log.exists() and "started" in log.read_text())
        logs = podium("logs", exp_id, "--data-dir", str(platform.data_dir))
        assert logs.returncode == 0, logs.stderr
        assert f"pod {pod} of {exp_id} started" in logs.stdout
        one = podium("logs", exp_id, pod, "--tail", "1", "--data-dir", str(platform.data_dir))
        assert one.stdout.count("\n") == 1 and "started" in one.stdout
        # Without the files (as against a cluster): through the orchestrator's API.
        remote = cli("logs", exp_id, pod, "--tail", "3", leaderboard=False)
        assert remote.returncode == 0, remote.stderr
        assert f"pod {pod} of {exp_id} started" in remote.stdout
        c.post(f"/experiments/{exp_id}/cancel")
    missing = cli("logs", "nope", leaderboard=False)
    assert missing.returncode != 0 and "not found" in missing.stderr


def test_logs_of_an_ended_experiment_show_its_ended_pods_last_lines(
    cli: Any, tmp_path: Path, platform: Platform
) -> None:
    """Against a deployment, `podium logs` of an ended experiment answered
    "has no pods now" (exit 1), so a CI gate that had just failed could not show why."""
    body = spec(target=None, crash_after_s=0.3)  # crash-loops: failed after crash_loop_limit
    exp_id = cli("submit", write_spec(tmp_path, body)).stdout.strip()
    with api(platform) as c:
        wait_for(lambda: c.get(f"/experiments/{exp_id}").json()["state"] == "failed")
        events = c.get(f"/experiments/{exp_id}/events").json()
    pods = [e["pod_id"] for e in events if e["type"] == "pod_failed"]
    assert len(pods) == FAST["crash_loop_limit"], events

    logs = cli("logs", exp_id, leaderboard=False)  # no DATA_DIR: through the orchestrator
    assert logs.returncode == 0, logs.stderr
    no_traceback(logs)
    assert "ended pods" in logs.stderr, logs.stderr
    for pod in pods:  # each pod labelled, how it ended, then its last lines
        head = f"==> pod {pod} (ended: failed, exit code 3) <=="
        assert head in logs.stdout, logs.stdout
        own = logs.stdout.split(head, 1)[1].split("==> pod", 1)[0]
        assert f"pod {pod} of {exp_id} started" in own
        assert own.rstrip().endswith("simulated crash: CUDA error: out of memory")
    one = cli("logs", exp_id, pods[0], "--tail", "1", leaderboard=False)
    assert one.returncode == 0, one.stderr
    assert one.stdout == "simulated crash: CUDA error: out of memory\n"


# -- bad input -----------------------------------------------------------------------------------


def test_missing_and_invalid_spec_files(cli: Any, tmp_path: Path) -> None:
    missing = cli("submit", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "nope.yaml: cannot read" in missing.stderr
    body = spec()
    body["population"] = {"min_pods": 0, "max_pods": 1}
    body["bogus"] = 1
    invalid = cli("submit", write_spec(tmp_path, body))
    assert invalid.returncode == 2
    assert "invalid experiment spec" in invalid.stderr
    assert "population.min_pods: Input should be greater than or equal to 1" in invalid.stderr
    assert "bogus: Extra inputs are not permitted" in invalid.stderr
    not_yaml = tmp_path / "bad.yaml"
    not_yaml.write_text("name: [unclosed\n")
    bad = cli("submit", str(not_yaml))
    assert bad.returncode == 2 and "not valid YAML" in bad.stderr
    run_invalid = podium("run", write_spec(tmp_path, body), "--out", str(tmp_path / "r"))
    assert run_invalid.returncode == 2 and "population.min_pods" in run_invalid.stderr
    assert not (tmp_path / "r").exists()  # refused before anything started
    for proc in (missing, invalid, bad, run_invalid):
        no_traceback(proc)


def test_unreachable_url_and_wrong_token(platform: Platform, tmp_path: Path) -> None:
    down = podium("status", "--url", "http://127.0.0.1:9", "--token", "x")
    assert down.returncode == 3
    assert "cannot reach the orchestrator at http://127.0.0.1:9" in down.stderr
    # The client's retry warnings were printed as JSON lines before the error.
    assert down.stderr.strip().splitlines() == [down.stderr.strip()], down.stderr
    assert down.stdout == ""
    wrong = podium("status", "--url", platform.orchestrator_url, "--token", "wrong")
    assert wrong.returncode == 3 and "401" in wrong.stderr and "refused" in wrong.stderr
    missing = podium("status", "--url", platform.orchestrator_url)
    assert missing.returncode == 3 and "needs a token" in missing.stderr
    lb_wrong = podium(
        "leaderboard", "x", "--url", platform.orchestrator_url, "--token", "wrong",
        "--leaderboard-url",
        platform.leaderboard_url,
    )  # fmt: skip
    assert (
        lb_wrong.returncode == 3 and "leaderboard" in lb_wrong.stderr and "401" in lb_wrong.stderr
    )
    for proc in (down, wrong, missing, lb_wrong):
        no_traceback(proc)


# -- podium up / podium run ----------------------------------------------------------------------


def test_a_platform_that_fails_to_start_leaves_no_pod_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The local backend (and its pod launcher process) is built before the services start;
    when a service then fails to start, the launcher goes too."""
    import services.leaderboard.app

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the leaderboard cannot start")

    monkeypatch.setattr(services.leaderboard.app, "create_app", broken)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    platform = Platform(
        data_dir=tmp_path / "data",
        orchestrator_port=0,
        leaderboard_port=0,
        orchestrator_overrides={"pod_launcher": True, "pod_command": None},
    )
    with pytest.raises(RuntimeError, match="the leaderboard cannot start"):
        platform.start()

    def left() -> list[psutil.Process]:
        kids = psutil.Process().children(recursive=True)
        return [p for p in kids if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]

    deadline = time.monotonic() + 10
    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left()


def test_up_serves_until_interrupted_then_stops_every_pod(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = clean_env(PODIUM_POD_COMMAND=json.dumps(POD_COMMAND), PODIUM_TERMINATION_GRACE_S="3")
    env.pop("LD_PRELOAD", None)  # the pods' malloc is then the machine's, or none
    up = subprocess.Popen(
        [*PODIUM, "up", "--data-dir", str(data), "--port", "0", "--leaderboard-port", "0"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        session = wait_for(lambda: read_session(data), timeout=30)
        # Found through the data directory: no URL, no token given.
        local = clean_env(PODIUM_DATA_DIR=str(data))
        empty = podium("status", env=local)
        assert empty.returncode == 0 and "no experiments" in empty.stdout, empty.stderr
        second = podium("up", "--data-dir", str(data), "--port", "0", "--leaderboard-port", "0")
        assert second.returncode == 3 and "another Podium platform is running" in second.stderr
        proc = podium("submit", write_spec(tmp_path, spec(target=None)), env=local)
        assert proc.returncode == 0, proc.stderr
        exp_id = proc.stdout.strip()
        pods_dir = data / "experiments" / exp_id / "pods"
        pid = wait_for(lambda: [json.loads(p.read_text())["pid"] for p in pods_dir.glob("*.json")])
        pod = psutil.Process(pid[0])
        # Only once the pod says it started has it installed its SIGTERM handler.
        log = wait_for(lambda: next(pods_dir.glob("*.log"), None))
        wait_for(lambda: "started" in log.read_text())
        up.send_signal(signal.SIGINT)
        out, err = up.communicate(timeout=30)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 0, err
    assert "Podium is up" in err and f"{session['orchestrator_url']}/api/v1/docs" in err
    # The services' JSON log lines were printed beside the banner; they go to a
    # file the banner names (``--verbose`` shows them instead).
    assert out == "" and '{"' not in err, (out, err)
    log_file = data / "podium.log"
    assert str(log_file) in err
    records = [json.loads(line) for line in log_file.read_text().splitlines()]
    assert {"platform started", "platform stopped"} <= {r["event"] for r in records}
    assert f"{session['leaderboard_url']}/metrics" in err and "stopped." in err
    real = malloc.find_allocator()
    assert f"  pods' malloc  {real.name if real else f'system ({malloc.NONE_FOUND})'}\n" in err
    assert not pod.is_running() or pod.status() == psutil.STATUS_ZOMBIE
    assert "SIGTERM: final report made" in log.read_text()
    assert read_session(data) is None and not (data / "platform.json").exists()
    assert (data / "redis" / "podium.rdb").exists()  # Redis saved on the way out
    # The services stop together; whichever leaves Redis last stops it: none is left behind.
    db = data / redis_client.EMBEDDED_SUBDIR / redis_client.DB_FILENAME
    assert not redis_client._running_elsewhere(db.resolve())
    assert "Traceback" not in err


def test_run_to_the_target_writes_results(tmp_path: Path) -> None:
    # Its pods say auto trained them eager where their programs in the cache would have
    # compiled (the real pod's record): the run names the command that fills its cache.
    eager = {"compiled": False, "warm": True, "reason": "auto: eager: a cold compile"}
    body = spec(
        name="standin-run",
        report_interval_s=0.1,
        score_step=10.0,
        env_steps_per_report=500,
        compile_decided=eager,
    )
    body["population"] = {"min_pods": 2, "max_pods": 2}
    out = tmp_path / "out"
    # An earlier platform on the same data left an experiment unfinished (its pods stopped).
    overrides = {**FAST, "pod_command": POD_COMMAND}
    with Platform(out / "data", orchestrator_port=0, leaderboard_port=0,
                  orchestrator_overrides=overrides) as earlier, api(earlier) as c:  # fmt: skip
        stale = c.post("/experiments", json=spec(name="stale", target=None)).json()["id"]
        wait_for(lambda: c.get(f"/experiments/{stale}").json()["state"] == "running")
    env = clean_env(
        PODIUM_POD_COMMAND=json.dumps(POD_COMMAND),
        PODIUM_TERMINATION_GRACE_S="3",
        PODIUM_RECONCILE_INTERVAL_S="0.1",
        PODIUM_PROGRESS_POLL_S="0.1",
        PODIUM_CAPACITY_CPU="2",
    )
    env.pop("LD_PRELOAD", None)  # the pods' malloc is then the machine's, or none
    proc = podium(
        "run", write_spec(tmp_path, body), "--out", str(out), "--port", "0",
        "--leaderboard-port", "0", env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # Pods without tcmalloc or jemalloc train slower: the run says so, and how to get one.
    hint = f"pods' malloc: system ({malloc.NONE_FOUND})\n"
    assert (hint in proc.stderr) == (malloc.find_allocator() is None), proc.stderr
    assert "succeeded: target return 50 reached" in proc.stderr
    advice = f"podium compile {tmp_path / 'spec.yaml'} --data-dir {out / 'data'}"
    assert f"trained eager, not compiled (auto: eager: a cold compile): `{advice}`" in proc.stderr
    assert f"cancelled unfinished experiment {stale} of an earlier run" in proc.stderr
    assert "final leaderboard of standin-run" in proc.stderr
    # Stand-in pods report scores only: there are no training files to export.
    assert "best agent not exported" in proc.stderr and "no training files" in proc.stderr
    for png in ("best_score.png", "candidates.png", "lineage.png"):
        assert (out / png).read_bytes().startswith(b"\x89PNG")
    samples = [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines()]
    assert samples[-1]["best"] >= 50 and samples[-1]["state"] == "succeeded"
    board = json.loads((out / "leaderboard.json").read_text())
    assert board["candidates"][0]["score"] >= 50
    candidates = json.loads((out / "candidates.json").read_text())
    # Every candidate ever inserted (evicted ones too), from both pods.
    assert len(candidates) > len(board["candidates"])
    assert len({c["pod_id"] for c in candidates}) == 2
    lineage = json.loads((out / "lineage.json").read_text())
    assert {n["candidate_id"] for n in lineage["nodes"]} == {c["candidate_id"] for c in candidates}
    # best_score.png's series: every report from the leaderboard's log, not the CLI's polls,
    # so the climb from 10 (each pod's first report) to the target is on it.
    from services.cli import plots

    reports = json.loads((out / "submissions.json").read_text())
    assert {r["pod_id"] for r in reports} == {c["pod_id"] for c in candidates}
    exp = json.loads((out / "experiment.json").read_text())
    series = plots.best_so_far(reports, exp["created_at"])
    assert series["best"][0] == 10.0 and series["best"][-1] >= 50
    assert series["best"] == sorted(series["best"]) and len(set(series["best"])) >= 5
    assert series["env_steps"][-1] == 500 * len(reports)
    assert 0 < series["t"][0] <= series["t"][-1]
    assert json.loads((out / "experiment.json").read_text())["state"] == "succeeded"
    assert not (out / "data" / "platform.json").exists()
    no_traceback(proc)


def test_run_interrupted_cancels_saves_results_and_stops_every_pod(tmp_path: Path) -> None:
    body = spec(name="forever", target=None, report_interval_s=0.1, score_step=1.0)
    out = tmp_path / "out"
    env = clean_env(PODIUM_POD_COMMAND=json.dumps(POD_COMMAND), PODIUM_TERMINATION_GRACE_S="3")
    run = subprocess.Popen(
        [*PODIUM, "run", write_spec(tmp_path, body), "--out", str(out), "--port", "0",
         "--leaderboard-port", "0"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        pods_dir = wait_for(lambda: next((out / "data" / "experiments").glob("*/pods"), None))
        logs = wait_for(lambda: list(pods_dir.glob("*.log")))
        wait_for(lambda: "started" in logs[0].read_text())
        run.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            _, err = run.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            run.kill()
            _, err = run.communicate()
            pytest.fail(f"podium run did not stop within 120 s of Ctrl-C; it said:\n{err[-3000:]}")
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 130, err
    assert "interrupted: cancelling" in err and "experiment cancelled" in err
    assert "SIGTERM: final report made" in logs[0].read_text()  # stopped gracefully
    assert json.loads((out / "experiment.json").read_text())["state"] == "cancelled"
    assert (out / "best_score.png").exists() and (out / "leaderboard.json").exists()
    assert (out / "data" / "redis" / "podium.rdb").exists()
    assert not (out / "data" / "platform.json").exists()
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "example",
    sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").glob("*.yaml")),
)
def test_examples_are_valid_specs_the_pod_can_train(example: str) -> None:
    import random

    from services.contracts.spec import load_spec
    from services.pod.runtime.rounds import pod_config

    spec = load_spec(ROOT / example)
    rng = random.Random(0)
    for seed in range(3):  # what the generator may hand a fresh pod
        hyperparameters = {k: d.sample(rng) for k, d in spec.search_space.items()}
        config = pod_config(spec, hyperparameters, seed=seed)
        assert config.env == spec.env.name
        assert config.agent_config.learning_rate == hyperparameters["learning_rate"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("example", "env_name", "target"),
    [("cartpole", "CartPole-v1", 475.0), ("pendulum", "Pendulum-v1", -200.0)],
)
def test_run_example_tournament_end_to_end(
    tmp_path: Path, example: str, env_name: str, target: float
) -> None:
    """The real thing (the README's command): pods train PPO, PBT among them, to the target."""
    from services.pod.training.checkpoint import read_files

    out = tmp_path / example
    proc = podium(
        "run", f"examples/{example}.yaml", "--out", str(out), "--port", "0",
        "--leaderboard-port", "0", "--timeout", "600",
        env=clean_env(), timeout=700,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"succeeded: target return {target:g} reached" in proc.stderr
    # Where a pod's auto declined a cold compile that a load from the cache would have turned
    # (its log says so: test_compiled.py has the cases), the run names the command that fills
    # this data directory's cache; else it says nothing of it.
    from services.cli.results import cold_compile_reason

    exp_id = json.loads((out / "experiment.json").read_text())["id"]
    advice = f"`podium compile examples/{example}.yaml --data-dir {out / 'data'}` compiles"
    declined = cold_compile_reason(out / "data", exp_id)
    assert (advice in proc.stderr) == (declined is not None), proc.stderr[-3000:]
    # The progress lines (CI's: stderr is no terminal) say what the running pods do. A pod's
    # log is read every 2 s, and a CartPole pod with its programs in the cache may reach the
    # target before it is read once: "starting" is all such a run shows, and is what the
    # line says (test_the_live_view_says_what_the_pods_say_they_do reads a pod's records).
    lines = [
        x for x in proc.stderr.splitlines() if re.match(r"\[\d+:\d\d:\d\d\] running +pods [1-9]", x)
    ]
    said = r" \| \d+ (pending|starting|loading|compiling|training|evaluating)\b"
    assert lines and all(re.search(said, x) for x in lines), lines
    best = json.loads((out / "best" / "candidate.json").read_text())
    assert best["score"] >= target
    files = read_files(out / "best")  # a complete, verified set of training files
    assert files.documents["hyperparameters"]["env"] == env_name
    for png in ("best_score.png", "candidates.png", "lineage.png"):
        assert (out / png).read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_run_an_ensemble_trains_each_algorithm_in_its_own_pod(tmp_path: Path) -> None:
    """`podium run` of a PPO + DQN ensemble on two pods: real pods, each told its algorithm by
    the orchestrator, and both algorithms' agents reach the leaderboard."""
    body = {
        "name": "ensemble",
        "env": {"name": "CartPole-v1"},
        "algorithms": {"ppo": 1.0, "dqn": 1.0},
        "population": {"min_pods": 2, "max_pods": 2},
        "resources": {"cpu": 1, "gpus": 0, "memory": "1Gi"},
        "round": {"env_steps": 2048},
        "budget": {"total_env_steps": 16384, "wall_time_s": 300},
        "top_k": 16,
    }
    out = tmp_path / "out"
    proc = podium(
        "run", write_spec(tmp_path, body), "--out", str(out), "--port", "0",
        "--leaderboard-port", "0", env=clean_env(), timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    candidates = json.loads((out / "candidates.json").read_text())
    by_pod: dict[str, set[str]] = {}
    for c in candidates:
        by_pod.setdefault(c["pod_id"], set()).add(c["algorithm"])
    assert sorted(a for algorithms in by_pod.values() for a in algorithms) == ["dqn", "ppo"]


@pytest.mark.slow
@pytest.mark.nightly  # a learning check of about 90 s (the PPO tournaments above stay in CI)
def test_run_the_portfolio_gradient_tournament_and_backtest_its_best(tmp_path: Path) -> None:
    """The stock-trading tournament of portfolio-gradient pods (PBT among them) until its
    env-step budget is spent; the best agent's files, exported, beat buy-and-hold's Sharpe
    over the held-out backtest period of the trend market (docs/benchmarks.md "Stock
    trading": every agent of its search space does on this market)."""
    from services.pod.training.checkpoint import read_files

    out = tmp_path / "pg"
    example = "examples/stock_trading_portfolio_gradient.yaml"
    proc = podium(
        "run", example, "--out", str(out), "--port", "0", "--leaderboard-port", "0",
        env=clean_env(), timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "env-step budget spent" in proc.stderr
    files = read_files(out / "best")
    assert files.manifest["algorithm"] == "portfolio_gradient"
    candidates = json.loads((out / "candidates.json").read_text())
    assert len(candidates) >= 8 and {c["algorithm"] for c in candidates} == {"portfolio_gradient"}
    backtest = podium("backtest", str(out / "best"), "--json", env=clean_env())
    assert backtest.returncode == 0, backtest.stderr
    sharpe = {k: v["sharpe"] for k, v in json.loads(backtest.stdout)["metrics"].items()}
    assert sharpe["agent"] > sharpe["buy-and-hold"] + 0.5, sharpe
    no_traceback(proc)


def test_the_experiment_list_follows_the_orchestrators_pages(platform: Platform) -> None:
    """The orchestrator answers a page at a time (newest first); the CLI's list is every one."""
    from services.cli.client import PodiumClient, resolve

    ends = resolve(platform.orchestrator_url, platform.token, platform.leaderboard_url)
    with PodiumClient(ends) as client:
        created = [client.submit(spec(target=None))["id"] for _ in range(3)]
        for exp_id in created:
            client.cancel(exp_id)
        listed = [e["id"] for e in client.experiments(page=2)]
    assert len(listed) == len(set(listed))  # no page read twice
    assert set(created) <= set(listed)
    assert listed.index(created[2]) < listed.index(created[0])  # newest first


@pytest.mark.parametrize("example", ["examples/cartpole.yaml", "examples/stock_trading.yaml"])
def test_an_examples_curl_line_submits_it(platform: Platform, example: str) -> None:
    """The comment's command, as a user pastes it after `podium up`'s `export` line: it used
    $PODIUM_API_TOKEN, which nothing sets (401)."""
    text = (ROOT / example).read_text()
    block = re.search(r"^#   (python -c .*?)\n(?!#     )", text, re.M | re.S)
    assert block is not None, example
    command = " ".join(line.lstrip("#").strip().rstrip("\\") for line in block[1].splitlines())
    env = clean_env(PODIUM_URL=platform.orchestrator_url, PODIUM_TOKEN=str(platform.token))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    proc = subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    created = json.loads(proc.stdout)
    assert created["name"] == yaml.safe_load(text)["name"], created
    with api(platform) as client:
        assert client.post(f"/experiments/{created['id']}/cancel").status_code in (200, 202)


def test_the_embedded_orchestrator_keeps_a_quick_pace_unless_told_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One machine and a few experiments: the embedded platform's orchestrator reconciles and
    asks the leaderboard for progress every half second instead of a cluster's 2 s, so an
    experiment (and ``podium run``) ends soon after the report that met its target. An
    operator's ``PODIUM_*`` setting, or an override, still decides."""
    for name in EMBEDDED_PACE:
        monkeypatch.delenv(f"PODIUM_{name.upper()}", raising=False)
    url = "http://127.0.0.1:1"
    settings = Platform(tmp_path).orchestrator_settings(url)
    assert settings.reconcile_interval_s == settings.progress_poll_s == 0.5
    overridden = Platform(tmp_path, orchestrator_overrides={"progress_poll_s": 1.5})
    assert overridden.orchestrator_settings(url).progress_poll_s == 1.5
    monkeypatch.setenv("PODIUM_RECONCILE_INTERVAL_S", "3")
    assert Platform(tmp_path).orchestrator_settings(url).reconcile_interval_s == 3.0
    monkeypatch.delenv("PODIUM_RECONCILE_INTERVAL_S")
    monkeypatch.setitem(EMBEDDED_PACE, "reconcile_interval_s", 0.0)  # validated as any setting
    with pytest.raises(ValidationError, match="reconcile_interval_s"):
        Platform(tmp_path).orchestrator_settings(url)


def test_the_banner_says_how_commands_find_a_platform_elsewhere(tmp_path, monkeypatch) -> None:
    """`podium up --data-dir D` said commands run in this directory find it: they look in
    ./data, and `podium status` there answered 401 (another platform's session, or none)."""
    from services.cli.tournament import finds_it

    monkeypatch.chdir(tmp_path)
    assert finds_it(tmp_path / "data") == "Commands run in this directory find it by themselves"
    other = tmp_path / "elsewhere"
    assert finds_it(other) == (
        f"Commands given --data-dir {other} (or PODIUM_DATA_DIR={other}) find it by themselves"
    )
