"""The compiled pod as deployed: the pod image (built by scripts/build-images.sh) run as the
chart runs it (its non-root user, read-only root, all capabilities dropped, /tmp a tmpfs, a
writable compile cache directory).

- In the image, ``compile: on`` trains CartPole with the compiled trainer, preloading tcmalloc
  and with MKL choosing its kernels by the CPU's instruction sets, and logs its compile
  seconds; a second pod with the same cache directory loads what the first compiled (no file
  added to the cache, a fraction of the compile seconds) instead of compiling.
- Through the Kubernetes backend (the in-test API server, its kubelet running every Pod as
  containers of the image, each with its own emptyDir cache), a 4-pod ``compile: on`` tournament
  compiles once: one pod compiles and publishes, the others build no graph and load (their
  seconds are printed, not asserted: containers sharing this machine's cores each import torch
  and load at once, docs/deploy.md). Each pod's last log lines and TensorBoard files reach the
  leaderboard's blob store before the pod is gone: `podium logs` and `podium tensorboard` (run
  from the control-plane image) read them afterwards.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.contracts.bundles import files_under
from services.pod import mkl_dispatch
from services.pod.runtime.compile_share import SKIP
from tests.containers.conftest import Docker
from tests.containers.test_platform import TOKEN, Service, run_experiment, spec, start_stack
from tests.pod.harness import TOKEN as LB_TOKEN
from tests.pod.harness import (
    Leaderboard,
    compile_trail,
    compile_work,
    eval_returns,
    make_spec,
    register,
)

pytestmark = [pytest.mark.container, pytest.mark.slow]

CACHE = "/var/cache/podium/compile"  # where the chart's pods keep it
COMPILE_ON = {
    "learning_rate": {"type": "log_uniform", "low": 4e-3, "high": 1.2e-2},
    "compile": {"type": "choice", "values": ["on"]},
}


def events(log: str) -> list[dict[str, Any]]:
    out = []
    for line in log.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def named(lines: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [x for x in lines if x.get("event") == event]


@pytest.fixture
def host_leaderboard(tmp_path: Path) -> Iterator[Leaderboard]:
    """The leaderboard on this host's loopback, which the containers reach (host network)."""
    lb = Leaderboard(tmp_path / "lb").start()
    yield lb
    lb.stop()


def train_in_image(
    docker: Docker, image: str, lb: Leaderboard, exp: str, pod: str, cache: Path
) -> list[dict[str, Any]]:
    """One pod of ``exp`` in ``image`` until its first report, then stopped (SIGTERM, as the
    chart's pods are): its log lines; it must exit 0."""
    spec = make_spec(search_space=COMPILE_ON)
    register(lb, exp, spec)
    env = {
        "PODIUM_EXPERIMENT_ID": exp,
        "PODIUM_POD_ID": pod,
        "PODIUM_SPEC": json.dumps(spec),
        "PODIUM_LEADERBOARD_URL": lb.url,
        "PODIUM_API_TOKEN": LB_TOKEN,
        "PODIUM_CPU": "1",
        "PODIUM_GPUS": "0",
        "PODIUM_LOG_JSON": "1",
        "PODIUM_COMPILE_CACHE_DIR": CACHE,
    }
    name = f"podium-ct-{pod}-{time.monotonic_ns()}"
    flags = [f"--env={k}={v}" for k, v in env.items()] + [f"--volume={cache}:{CACHE}"]
    docker.run(name, image, flags=flags)
    deadline = time.monotonic() + 900
    while '"pod.first_report"' not in (log := docker.logs(name)):
        state = docker.inspect(name)["State"]
        assert state["Running"], f"the pod exited ({state['ExitCode']}):\n{log[-4000:]}"
        assert time.monotonic() < deadline, f"no report in 900 s:\n{log[-4000:]}"
        time.sleep(2)
    docker("stop", "-t", "30", name, timeout=90)
    log = docker.logs(name)
    assert docker.inspect(name)["State"]["ExitCode"] == 0, log[-4000:]
    return events(log)


def test_the_pod_image_trains_compiled_and_a_second_pod_loads_the_cache(
    images: dict[str, str], docker: Docker, host_leaderboard: Leaderboard, tmp_path: Path
) -> None:
    assert docker.inspect(images["pod"])["Config"]["User"] == "10001:10001"
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)  # a volume the pod's user may write, as an emptyDir is
    cold = train_in_image(docker, images["pod"], host_leaderboard, "cold", "p0", cache)
    [started] = named(cold, "pod started")
    assert started["malloc"] == "tcmalloc", started  # preloaded by the pod itself
    # MKL's kernels by the CPU's instruction sets (services/pod/mkl_dispatch.py): built with
    # the image's compiler into the pod's cache volume (the root is read-only).
    reason = mkl_dispatch.wanted(Path("/proc/cpuinfo").read_text(), platform.machine())
    assert started["mkl_dispatch"] == ("features" if reason is None else f"vendor: {reason}")
    [chosen] = named(cold, "trainer.chosen")
    assert chosen["compiled"] is True, chosen  # a compiler in the image: not the eager loop
    assert compile_work(cold)["built"] > 0, named(cold, "compile.done")
    [published] = named(cold, "compile_cache.published")
    assert published["files"] > 0, published

    # Another experiment (nothing published for it) on the same cache directory: it loads
    # what the first compiled (no file added to the cache), and publishes it for its
    # experiment's other pods at once (the cache's index knows the key's files).
    held = files_under(cache, SKIP)
    warm = train_in_image(docker, images["pod"], host_leaderboard, "warm", "p1", cache)
    [chosen] = named(warm, "trainer.chosen")
    assert chosen["compiled"] is True, chosen
    assert set(files_under(cache, SKIP)) == set(held)
    [published] = named(warm, "compile_cache.published")
    assert published["from_cache"] and published["files"] > 0, published
    work = compile_work(warm)
    assert work["built"] == 0 and work["loaded"] > 0, (work, compile_work(cold))
    [first_step] = named(warm, "pod.first_env_step")
    print(f"warm pod: first env step {first_step['seconds']:.2f} s after its process started")


def test_a_kubernetes_tournament_compiles_once_and_keeps_every_pods_files(
    images: dict[str, str], docker: Docker, tmp_path: Path
) -> None:
    stack = start_stack(images, docker)
    body = {
        **spec("cartpole-compiled"),
        "search_space": COMPILE_ON,
        "population": {"min_pods": 4, "max_pods": 4},
        "resources": {"cpu": 0.5, "gpus": 0, "memory": "1Gi"},
        "round": {"env_steps": 2048},
        # No target: the compiling pod could reach it before the others trained a step; every
        # pod trains until the budget is spent.
        "target_return": None,
        "budget": {"total_env_steps": 300 * 1024, "wall_time_s": 900},
    }
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)
    cli: dict[str, str] = {}

    def read_back(exp_id: str, orch: Service) -> None:
        """`podium logs` and `podium tensorboard` from the control-plane image, the pods gone."""
        lb = stack["leaderboard"]
        for command in (
            ["logs", exp_id, "--tail", "3"],
            ["tensorboard", exp_id, "--out", "/out/tb"],
        ):
            cli[command[0]] = docker(
                "run", "--rm", "--network", "host", "--label", docker.label,
                "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                "--tmpfs", "/tmp", f"--volume={out}:/out", f"--env=PODIUM_API_TOKEN={TOKEN}",
                "--entrypoint", "podium", images["control-plane"], *command,
                "--url", orch.url, "--leaderboard-url", lb.url,
                timeout=300, stderr=True,
            )  # fmt: skip

    _, cluster = run_experiment(docker, images, stack, tmp_path, body, 3, read_back)
    runs = list(cluster.runs.values())
    # The four, and any started for the budget left by pods whose share of it was spent.
    assert len(runs) >= 4, [r.manifest["metadata"]["name"] for r in runs]
    pods = {r.manifest["metadata"]["labels"]["podium.dev/pod"]: events(r.logs["pod"]) for r in runs}
    states = {
        pod: [x["state"] for x in lines if x["event"].startswith("compile_cache.") and "state" in x]
        for pod, lines in pods.items()
    }
    compilers = [pod for pod, s in states.items() if "claimed" in s]
    assert len(compilers) == 1, compile_trail(pods)
    [first] = compilers
    assert all(states[p][-1] == "loaded" for p in pods if p != first), compile_trail(pods)
    work = {pod: compile_work(lines) for pod, lines in pods.items()}
    print(f"compile work by pod: {work}; {first} compiled, the others loaded")
    # Compiled once: the others built no graph (their compile seconds are their loads).
    assert work[first]["built"] > 0, work
    assert all(w["built"] == 0 for p, w in work.items() if p != first), work
    for pod, lines in pods.items():
        for step in named(lines, "pod.first_env_step"):
            print(f"{pod}: first env step {step['seconds']:.2f} s after its process started")
    for pod in list(pods)[:4]:  # the four trained: their programs ran, compiled or loaded
        assert named(pods[pod], "compile.done") and named(pods[pod], "pod.first_env_step"), pod
    for lines in pods.values():
        assert named(lines, "trainer.chosen")[0]["compiled"] is True

    # Each pod's own last lines (its final report and "pod stopped") and its curves.
    for pod in pods:
        head = f"==> pod {pod} (ended"
        assert head in cli["logs"], cli["logs"]
        own = cli["logs"].split(head, 1)[1].split("==> pod", 1)[0]
        assert '"pod stopped"' in own, own
    assert "tensorboard --logdir /out/tb" in cli["tensorboard"], cli["tensorboard"]
    for pod in pods:
        assert eval_returns(out / "tb" / pod), pod
