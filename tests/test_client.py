"""The CLI's API client: where it connects, how it judges an ended experiment, and how export
verifies training files against the real leaderboard."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.cli.client import (
    EXIT_API,
    ApiError,
    Endpoints,
    PodiumClient,
    describe_422,
    reached,
    resolve,
)
from services.cli.errors import EXIT_USAGE, CliError
from services.leaderboard.app import create_app
from services.leaderboard.settings import LeaderboardSettings
from tests.orchestrator.servers import ServerThread

TOKEN = "client-test-token"


def experiment(state: str, best: float | None, target: float | None = 100.0, **kw: Any) -> dict:
    return {
        "state": state,
        "reason": kw.get("reason", "why"),
        "result": {"best": None if best is None else {"score": best}},
        "spec": {
            "target_return": target,
            "evaluation": {"higher_is_better": kw.get("higher", True)},
        },
    }


@pytest.mark.parametrize(
    ("exp", "min_reward", "ok", "words"),
    [
        (experiment("succeeded", 120.0), None, True, "succeeded"),
        (experiment("budget_exhausted", 50.0), None, False, "target return not reached"),
        (experiment("budget_exhausted", 50.0, target=None), None, True, "finished"),
        (experiment("failed", 500.0), None, False, "experiment failed"),
        (experiment("failed", 500.0), 10.0, False, "experiment failed"),
        (experiment("cancelled", 500.0), 10.0, False, "experiment cancelled"),
        (experiment("succeeded", 120.0), 100.0, True, "best score 120 >= min reward 100"),
        (experiment("succeeded", 120.0), 200.0, False, "best score 120 < min reward 200"),
        (experiment("budget_exhausted", None), 1.0, False, "no evaluated agent"),
        (experiment("budget_exhausted", 90.0, target=None), 100.0, False, "< min reward 100"),
        (experiment("succeeded", 4.0, higher=False), 5.0, True, "best score 4 <= min reward 5"),
        (experiment("succeeded", 6.0, higher=False), 5.0, False, "best score 6 > min reward 5"),
    ],
)
def test_gate_verdicts(exp: dict, min_reward: float | None, ok: bool, words: str) -> None:
    got, why = reached(exp, min_reward)
    assert got is ok and words in why


def test_422_names_the_fields() -> None:
    detail = [
        {"loc": ["body", "population", "min_pods"], "msg": "too small", "type": "x"},
        {"loc": ["body"], "msg": "bad body", "type": "y"},
    ]
    text = describe_422(detail, "experiment spec")
    assert text.splitlines() == [
        "invalid experiment spec:",
        "  population.min_pods: too small",
        "  (root): bad body",
    ]


def test_resolve_explicit_then_running_platform_then_defaults(tmp_path: Path) -> None:
    assert resolve(data_dir=tmp_path).url == "http://127.0.0.1:8000"
    assert resolve(data_dir=tmp_path).leaderboard_url == "http://127.0.0.1:8001"
    session = {
        "orchestrator_url": "http://127.0.0.1:7000",
        "leaderboard_url": "http://127.0.0.1:7001",
        "token": "s3cret",
        "pid": os.getpid(),
        "data_dir": str(tmp_path),
    }
    (tmp_path / "platform.json").write_text(json.dumps(session))
    found = resolve(data_dir=tmp_path)
    assert (found.url, found.leaderboard_url, found.token, found.leaderboard_token) == (
        "http://127.0.0.1:7000",
        "http://127.0.0.1:7001",
        "s3cret",
        "s3cret",
    )
    explicit = resolve(url="http://h:1", token="t", data_dir=tmp_path)
    assert (explicit.url, explicit.token, explicit.leaderboard_url) == ("http://h:1", "t", None)
    # A session file left by a platform that was killed is ignored.
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    (tmp_path / "platform.json").write_text(json.dumps({**session, "pid": int(dead.stdout)}))
    assert resolve(data_dir=tmp_path).url == "http://127.0.0.1:8000"


def test_without_a_leaderboard_url_the_orchestrator_is_asked_for_it() -> None:
    client = PodiumClient(Endpoints("http://127.0.0.1:9", None, None, None, "test"))
    with pytest.raises(ApiError, match="cannot reach the orchestrator at http://127.0.0.1:9"):
        client.best("x")  # the orchestrator says where its leaderboard is
    with pytest.raises(ApiError, match="cannot reach the orchestrator at http://127.0.0.1:9") as e:
        client.experiment("x")
    assert e.value.exit_code == EXIT_API


# -- export against the real leaderboard ----------------------------------------------------------


@pytest.fixture
def board(tmp_path: Path) -> Iterator[tuple[PodiumClient, Any]]:
    settings = LeaderboardSettings(data_dir=tmp_path / "lb", api_token=TOKEN, gc_interval_s=3600)
    with ServerThread(create_app(settings)) as srv:
        client = PodiumClient(Endpoints("http://127.0.0.1:9", srv.url, None, TOKEN, "test"))
        r = client.leaderboard.http.put("/experiments/e1", json={"top_k": 4})
        assert r.status_code == 201, r.text
        yield client, client.leaderboard.http
        client.close()


def submit(http: Any, sid: str, score: float, files: dict[str, bytes]) -> dict[str, Any]:
    result = {
        "submission_id": sid,
        "pod_id": "pod-1",
        "algorithm": "ppo",
        "score": score,
        "eval": {"mean": score, "episodes": 1},
        "files": {n: hashlib.sha256(b).hexdigest() for n, b in files.items()},
    }
    parts: dict[str, Any] = {"result": (None, json.dumps(result), "application/json")}
    parts.update({n: (n, b, "application/octet-stream") for n, b in files.items()})
    r = http.post("/experiments/e1/submissions", files=parts)
    assert r.status_code == 200 and r.json()["accepted"], r.text
    return r.json()


def manifest(files: dict[str, bytes], **lie: Any) -> bytes:
    entries = {
        n: {"sha256": hashlib.sha256(b).hexdigest(), "bytes": len(b)} for n, b in files.items()
    }
    entries.update(lie)
    return json.dumps({"format": "podium.training-files/1", "files": entries}).encode()


def test_export_best_and_a_chosen_candidate(board: tuple[PodiumClient, Any], tmp_path: Path):
    client, http = board
    weights = {"actor.safetensors": os.urandom(3 << 20)}  # several download chunks
    first = submit(http, "s1", 1.0, {**weights, "manifest.json": manifest(weights)})
    other = {"actor.safetensors": b"second agent"}
    submit(http, "s2", 2.0, {**other, "manifest.json": manifest(other)})

    cand = client.export("e1", tmp_path / "best")
    assert cand.score == 2.0
    assert (tmp_path / "best" / "actor.safetensors").read_bytes() == b"second agent"
    assert json.loads((tmp_path / "best" / "candidate.json").read_text())["score"] == 2.0

    chosen = client.export("e1", tmp_path / "best", candidate_id=first["candidate_id"])
    assert chosen.candidate_id == first["candidate_id"]
    assert (tmp_path / "best" / "actor.safetensors").read_bytes() == weights["actor.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "lb"]  # no temp dirs left


def test_export_never_replaces_what_it_did_not_write(
    board: tuple[PodiumClient, Any], tmp_path: Path
):
    """An export replaces its directory whole: a file, or a directory of the user's own files,
    is refused before anything is downloaded (both were replaced, and exit 0); an earlier
    export's directory is replaced."""
    client, http = board
    weights = {"actor.safetensors": b"weights"}
    submit(http, "s1", 1.0, {**weights, "manifest.json": manifest(weights)})
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(CliError, match="notes.txt: exists and is not a directory") as e:
        client.export("e1", notes)
    assert e.value.exit_code == EXIT_USAGE and notes.read_text() == "mine"
    thesis = tmp_path / "work" / "thesis.txt"
    thesis.parent.mkdir()
    thesis.write_text("mine")
    with pytest.raises(CliError, match="work: holds other files"):
        client.export("e1", thesis.parent)
    assert thesis.read_text() == "mine"
    with pytest.raises(CliError, match="cannot create it"):
        client.export("e1", notes / "best")
    (tmp_path / "empty").mkdir()
    client.export("e1", tmp_path / "empty")
    client.export("e1", tmp_path / "empty")  # an earlier export: replaced
    assert (tmp_path / "empty" / "actor.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "lb", "notes.txt", "work"]


def test_export_refuses_files_that_contradict_their_manifest(
    board: tuple[PodiumClient, Any], tmp_path: Path
) -> None:
    """The leaderboard's sha256 matches what it stored, but the manifest (what the pod wrote)
    says otherwise: the pod's own check refuses it, and nothing lands in OUT."""
    client, http = board
    weights = {"actor.safetensors": b"weights"}
    wrong = manifest(weights, **{"actor.safetensors": {"sha256": "0" * 64, "bytes": 7}})
    submit(http, "s1", 1.0, {**weights, "manifest.json": wrong})
    with pytest.raises(
        ApiError,
        match="actor.safetensors: size or sha256 does not match the manifest.*nothing was exported",
    ):
        client.export("e1", tmp_path / "out")
    truncated = manifest(
        weights,
        **{"actor.safetensors": {"sha256": hashlib.sha256(b"weights").hexdigest(), "bytes": 8}},
    )
    submit(http, "s2", 2.0, {**weights, "manifest.json": truncated})
    with pytest.raises(ApiError, match="does not match the manifest"):
        client.export("e1", tmp_path / "out")
    missing = manifest(weights, **{"critic.safetensors": {"sha256": "1" * 64, "bytes": 1}})
    submit(http, "s3", 3.0, {**weights, "manifest.json": missing})
    with pytest.raises(ApiError, match="file critic.safetensors is missing"):
        client.export("e1", tmp_path / "out")
    escape = manifest(weights, **{"../outside.json": {"sha256": "1" * 64, "bytes": 1}})
    submit(http, "s4", 4.0, {**weights, "manifest.json": escape})
    with pytest.raises(ApiError, match="bad file name '../outside.json'"):
        client.export("e1", tmp_path / "out")
    foreign = json.dumps({"format": "other/9", "files": {}}).encode()
    submit(http, "s5", 5.0, {**weights, "manifest.json": foreign})
    with pytest.raises(ApiError, match="unsupported checkpoint format 'other/9'"):
        client.export("e1", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lb"]


def test_the_pod_checks_training_files_with_the_cli_s_checks() -> None:
    """`podium export` runs on machines without torch (tests/test_layers.py): the manifest
    check it shares with the pod is the torch-free one, not a copy."""
    import services.contracts.training_files as t
    import services.pod.training.checkpoint as c

    assert c.read_manifest is t.read_manifest and c.CheckpointError is t.CheckpointError
    assert c.write_files is t.write_files and c.MANIFEST == t.MANIFEST


def test_export_of_a_score_only_candidate_and_unknown_ids(board: tuple[PodiumClient, Any]):
    client, http = board
    r = http.post(
        "/experiments/e1/submissions",
        json={
            "submission_id": "m",
            "pod_id": "p",
            "algorithm": "ppo",
            "score": 1.0,
            "eval": {"mean": 1.0},
        },
    )
    assert r.status_code == 200, r.text
    with pytest.raises(ApiError, match="has no training files to export"):
        client.export("e1", Path("unused"))
    with pytest.raises(ApiError, match="no candidate 'nope'") as e:
        client.export("e1", Path("unused"), candidate_id="nope")
    assert e.value.status == 404
    with pytest.raises(ApiError, match="unknown experiment 'e2'"):
        client.best("e2")


def test_submission_log_and_flat_lineage_are_read_whole(board: tuple[PodiumClient, Any]) -> None:
    client, http = board
    for i, score in enumerate([1.0, 3.0, 2.0, 5.0, 4.0, 0.5]):
        r = http.post(
            "/experiments/e1/submissions",
            json={
                "submission_id": f"r{i}",
                "pod_id": f"p{i % 2}",
                "algorithm": "ppo",
                "score": score,
                "env_steps": 10 * i,
                "eval": {"mean": score},
            },
        )
        assert r.status_code == 200, r.text
    log = client.submissions("e1", page=4)  # two pages
    assert [s.submission_id for s in log] == [f"r{i}" for i in range(6)]
    assert [s.env_steps for s in log] == [10 * i for i in range(6)]
    assert [s.accepted for s in log] == [True, True, True, True, True, False]
    nodes = client.lineage("e1").nodes
    assert [n.candidate_id for n in nodes] == [s.candidate_id for s in log[:5]]
