"""`podium logs` and `podium tensorboard` read what pods kept in the leaderboard's blob store
(services/pod/runtime/pod_files.py), as a user runs them against a deployment (`--url` and a
token; no data directory): the real embedded platform, its pods the stand-in pod, their files
uploaded through the leaderboard's pod route as a pod uploads them."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.contracts.artifacts import TENSORBOARD_KIND
from services.contracts.bundles import files_under, pack
from services.contracts.credentials import pod_token
from tests.pod.harness import eval_returns
from tests.test_cli_platform import api, no_traceback, platform, podium, spec, wait_for, write_spec

__all__ = ["platform"]  # the module-scoped platform fixture, shared

pytestmark = pytest.mark.slow


def upload(lb: str, token: str, exp: str, pod: str, name: str, data: bytes) -> dict[str, Any]:
    """As the pod does: with its experiment's credential."""
    r = httpx.put(
        f"{lb}/api/v1/experiments/{exp}/pods/{pod}/files/{name}",
        content=data,
        headers={"Authorization": f"Bearer {pod_token(token, exp)}"},
    )
    r.raise_for_status()
    return r.json()


def board(tmp_path: Path, pod: str) -> bytes:
    """A pod's TensorBoard directory, bundled as the pod bundles it."""
    from services.pod.training.tensorboard import Board

    src = tmp_path / f"board-{pod}"
    b = Board(src, min_interval_s=0.0)
    for step in range(3):
        b.scalars({"eval/return": 10.0 * step}, step)
    b.close()
    out = io.BytesIO()
    pack(src, files_under(src), {"kind": TENSORBOARD_KIND, "pod": pod}, out)
    return out.getvalue()


def test_logs_and_tensorboard_read_what_ended_pods_kept(platform: Any, tmp_path: Path) -> None:
    auth = ["--url", platform.orchestrator_url, "--token", str(platform.token)]
    lb = platform.leaderboard_url
    body = spec(target=None, crash_after_s=0.3)  # crash-loops: failed, its pods ended
    exp_id = podium("submit", write_spec(tmp_path, body), *auth).stdout.strip()
    with api(platform) as c:
        wait_for(lambda: c.get(f"/experiments/{exp_id}").json()["state"] == "failed")
        events = c.get(f"/experiments/{exp_id}/events").json()
    pods = [e["pod_id"] for e in events if e["type"] == "pod_failed"]
    token = str(platform.token)
    # The first pod uploaded its last lines as it exited (the orchestrator's kept lines are
    # what it read when the pod ended; the pod's own go further).
    upload(lb, token, exp_id, pods[0], "log", b"line 1\nfinal report\npod stopped\n")
    upload(lb, token, exp_id, "p-older", "log", b"an older pod's last line\n")
    for pod in pods:
        upload(lb, token, exp_id, pod, "tensorboard", board(tmp_path, pod))

    logs = podium("logs", exp_id, *auth)
    assert logs.returncode == 0, logs.stderr
    no_traceback(logs)
    own = logs.stdout.split(f"==> pod {pods[0]} (ended: failed", 1)[1].split("==> pod", 1)[0]
    assert own.splitlines()[1:] == ["line 1", "final report", "pod stopped"], own
    other = logs.stdout.split(f"==> pod {pods[1]} (ended: failed", 1)[1].split("==> pod", 1)[0]
    assert "simulated crash" in other  # no upload: the orchestrator's lines
    assert "==> pod p-older (ended) <==" in logs.stdout
    one = podium("logs", exp_id, pods[0], "--tail", "1", *auth)
    assert one.returncode == 0 and one.stdout == "pod stopped\n", one

    out = tmp_path / "boards"
    boards = podium("tensorboard", exp_id, "--out", str(out), *auth)
    assert boards.returncode == 0, boards.stderr
    assert f"tensorboard --logdir {out}" in boards.stderr
    for pod in pods:
        assert eval_returns(out / pod) == [0.0, 10.0, 20.0]

    # A bundle changed in the store: refused with the pod named, nothing of it written.
    upload(lb, token, exp_id, "p-tampered", "tensorboard", board(tmp_path, "p-tampered"))
    sha = httpx.get(
        f"{lb}/api/v1/experiments/{exp_id}/pod-files",
        headers={"Authorization": f"Bearer {token}"},
    ).json()[-1]["sha256"]
    blob = platform.data_dir / "blobs" / sha[:2] / sha[2:4] / sha
    blob.chmod(0o644)
    blob.write_bytes(blob.read_bytes()[:-4] + b"XXXX")
    bad = podium("tensorboard", exp_id, "--out", str(tmp_path / "bad"), *auth)
    assert bad.returncode == 3 and "does not match" in bad.stderr, bad.stderr
    assert not (tmp_path / "bad" / "p-tampered").exists()
    no_traceback(bad)
    none = podium("tensorboard", "no-such-exp", *auth)
    assert none.returncode != 0
    no_traceback(none)
