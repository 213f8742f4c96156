"""A Docker engine and Podium's images for the container tests.

The engine is the one `docker info` reaches (DOCKER_HOST or the default socket); otherwise, as
root, a private dockerd this fixture starts and stops by PID (own socket, data-root
/var/lib/podium-docker outside the clone so image layers survive between runs, --bridge=none
--iptables=false). Where neither works, every container test is skipped with the reason. The
images are built by scripts/build-images.sh, as a user would build them.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA_ROOT = Path(os.environ.get("PODIUM_DOCKER_ROOT", "/var/lib/podium-docker"))
TAG = "latest"
CONTROL_PLANE = f"podium-control-plane:{TAG}"
POD = f"podium-pod:{TAG}"
BUILT = ("control-plane", "pod", "redis", "prometheus")
# The chart's container security settings (helm/podium values), as `docker run` flags.
HARDENED = [
    "--read-only",
    "--cap-drop",
    "ALL",
    "--security-opt",
    "no-new-privileges",
    "--tmpfs",
    "/tmp",
]


class Docker:
    """The docker CLI against one engine; every container it starts carries ``label``."""

    def __init__(self, env: dict[str, str], label: str) -> None:
        self.env, self.label = env, label

    def __call__(
        self, *args: str, check: bool = True, timeout: float = 120, stderr: bool = False
    ) -> str:
        """stdout (and stderr, with ``stderr``: the CLI prints its messages there)."""
        proc = subprocess.run(
            ["docker", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"docker {' '.join(args[:3])} ...: {proc.stderr.strip()}")
        return (proc.stdout + proc.stderr if stderr else proc.stdout).strip()

    def run(
        self,
        name: str,
        image: str,
        *args: str,
        flags: list[str] | None = None,
        hardened: bool = True,
    ) -> str:
        """Start a detached container on the host's network (the engine may have no bridge):
        the services meet on 127.0.0.1 at distinct ports. ``hardened``: with the chart's
        security settings (``HARDENED``); else only what ``flags`` say."""
        return self(
            "run",
            "-d",
            "--name",
            name,
            "--label",
            self.label,
            "--network",
            "host",
            *(HARDENED if hardened else []),
            *(flags or []),
            image,
            *args,
        )

    def inspect(self, name: str) -> dict[str, Any]:
        return json.loads(self("inspect", name))[0]

    def logs(self, name: str) -> str:
        proc = subprocess.run(
            ["docker", "logs", name], env=self.env, capture_output=True, text=True, check=False
        )
        return proc.stdout + proc.stderr

    def remove_all(self) -> None:
        ids = self("ps", "-aq", "--filter", f"label={self.label}", check=False).split()
        if ids:
            self("rm", "-f", *ids, check=False)
        vols = self("volume", "ls", "-q", "--filter", f"label={self.label}", check=False).split()
        if vols:
            self("volume", "rm", "-f", *vols, check=False)


def _answers(env: dict[str, str]) -> str | None:
    """None when an engine answers, else why not."""
    try:
        proc = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "docker info timed out"
    return None if proc.returncode == 0 else (proc.stderr.strip() or "docker info failed")


#: How long a session waits for another one's engine: below pytest-timeout's 600 s per test,
#: which the first container test's set-up counts against.
ENGINE_WAIT_S = 480.0


def _locked(lock: TextIO, wait_s: float) -> bool:
    """Take ``lock``'s exclusive flock within ``wait_s``; whether it was taken."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(1.0)


def _stop_orphaned_engines() -> None:
    """Stop any dockerd still running on ``DATA_ROOT``: called with its lock held, so its session
    is gone (killed before its teardown); left running, it keeps the new engine from starting."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if not argv[0].endswith(b"dockerd") or b"--data-root" not in argv:
            continue
        if argv[argv.index(b"--data-root") + 1].decode() != str(DATA_ROOT):
            continue
        pid = int(proc.name)
        os.kill(pid, signal.SIGTERM)
        for _ in range(60):
            if not _running(pid):
                break
            time.sleep(0.5)
        else:
            os.kill(pid, signal.SIGKILL)
        if b"--exec-root" in argv:  # its network namespace stays bind-mounted there
            exec_root = Path(argv[argv.index(b"--exec-root") + 1].decode())
            _unmount_under(exec_root)
            if exec_root.parent.name.startswith("podium-dockerd-"):  # this fixture's run dir
                shutil.rmtree(exec_root.parent, ignore_errors=True)


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (an exited process its parent has not reaped yet does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _unmount_under(directory: Path) -> None:
    for line in Path("/proc/mounts").read_text().splitlines():
        if line.split()[1].startswith(f"{directory}/"):
            subprocess.run(["umount", line.split()[1]], check=False)


@pytest.fixture(scope="session")
def engine() -> Iterator[dict[str, str]]:
    """The environment under which `docker` reaches a running engine."""
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI (scripts/install-deploy-tools.sh installs docker.io as root)")
    env = dict(os.environ)
    why = _answers(env)
    if why is None:
        yield env
        return
    dockerd = shutil.which("dockerd")
    if os.geteuid() != 0 or dockerd is None:
        reason = "not root" if os.geteuid() != 0 else "no dockerd"
        pytest.skip(f"no Docker engine answers ({why}) and none can be started here: {reason}")
    run_dir = Path(tempfile.mkdtemp(prefix="podium-dockerd-", dir="/run"))
    DATA_ROOT.mkdir(parents=True, exist_ok=True)
    # One engine per data-root at a time (as scripts/build-images.sh): a concurrent session
    # waits here until the other one's engine is gone, but not past the test's timeout (its
    # container tests run for many minutes): then these are skipped, saying why.
    lock = (DATA_ROOT.parent / f"{DATA_ROOT.name}.lock").open("w")
    if not _locked(lock, ENGINE_WAIT_S):
        lock.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        pytest.skip(
            f"another test session on this machine has held the Docker engine of {DATA_ROOT} "
            f"for over {ENGINE_WAIT_S:.0f} s (set PODIUM_DOCKER_ROOT to use another data-root)"
        )
    _stop_orphaned_engines()
    env["DOCKER_HOST"] = f"unix://{run_dir}/docker.sock"
    # Only Podium uses this data-root: scripts/build-images.sh may prune every dangling image
    # (the build stages a rebuild replaced), not just the ones it replaced itself.
    env["PODIUM_PRUNE_DANGLING"] = "1"
    log = run_dir / "dockerd.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                dockerd,
                "--host",
                env["DOCKER_HOST"],
                "--data-root",
                str(DATA_ROOT),
                "--exec-root",
                str(run_dir / "exec"),
                "--pidfile",
                str(run_dir / "dockerd.pid"),
                "--bridge=none",
                "--iptables=false",
                "--ip6tables=false",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while (why := _answers(env)) is not None and proc.poll() is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if why is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-5:])
            pytest.skip(f"a private dockerd could not be started here ({why}):\n{tail}")
        yield env
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        _unmount_under(run_dir)  # dockerd leaves the host network namespace bind-mounted
        for _ in range(10):  # dockerd's containerd may still be removing its sockets
            shutil.rmtree(run_dir, ignore_errors=True)
            if not run_dir.exists():
                break
            time.sleep(0.5)
        lock.close()


@pytest.fixture(scope="session")
def images(engine: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Podium's images and the Debian-built Redis and Prometheus, by scripts/build-images.sh."""
    log = tmp_path_factory.mktemp("build") / "build-images.log"
    with log.open("wb") as out:
        proc = subprocess.run(
            [str(ROOT / "scripts" / "build-images.sh"), *BUILT],
            env={**engine, "PODIUM_IMAGE_TAG": TAG},
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=1800,
            check=False,
        )
    lines = log.read_text(errors="replace").splitlines()
    assert proc.returncode == 0, "scripts/build-images.sh failed:\n" + "\n".join(lines[-30:])
    for line in lines:
        if line.startswith("[build-images] podium-"):
            print(line)
    return {"control-plane": CONTROL_PLANE, "pod": POD, "redis": f"podium-redis:{TAG}"}


@pytest.fixture
def docker(engine: dict[str, str]) -> Iterator[Docker]:
    d = Docker(engine, f"podium.test.run={os.getpid()}-{time.monotonic_ns()}")
    yield d
    d.remove_all()
