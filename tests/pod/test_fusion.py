"""Learner fusion: parameter and optimiser-moment averaging across real processes (gloo)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.pod.config import PPORunConfig
from services.pod.training.fit import train
from services.pod.training.fusion import StateAverager, run_group
from services.pod.training.presets import preset


def _replica_state(rank: int) -> dict[str, torch.Tensor]:
    """A trainer's state (services/pod/algorithms/ppo.py) with rank-specific weights, Adam
    moments and statistics."""
    g = torch.Generator().manual_seed(100 + rank)
    state = {key: torch.randn(1, 11, generator=g) for key in ("params", "exp_avg")}
    state["exp_avg_sq"] = torch.rand(1, 11, generator=g)
    state["adam_step"] = torch.full((1,), 3.0)
    for key in ("obs_mean", "obs_var"):
        state[key] = torch.rand(1, 4, generator=g, dtype=torch.float64)
    for key in ("ret_mean", "ret_var"):
        state[key] = torch.rand(1, generator=g, dtype=torch.float64)
    return state


def _average_and_save(rank: int, world: int, directory: str, *_: object) -> None:
    state = _replica_state(rank)
    StateAverager(state)()
    save_file(state, f"{directory}/rank{rank}.safetensors")


def test_two_processes_average_exactly(tmp_path):
    run_group(_average_and_save, 2, args=(str(tmp_path),))
    before = [_replica_state(rank) for rank in range(2)]
    after = [load_file(tmp_path / f"rank{rank}.safetensors") for rank in range(2)]
    assert before[0].keys() == after[0].keys()
    for key in StateAverager.KEYS:
        expected = (before[0][key] + before[1][key]) / 2
        assert not torch.equal(before[0][key], before[1][key]), key  # the test has teeth
        # Bit-exact: a two-way sum then a halving is exact in IEEE arithmetic.
        assert torch.equal(after[0][key], expected), key
        assert torch.equal(after[1][key], expected), key
    # Adam's step counts are equal on every replica: left alone.
    assert torch.equal(after[0]["adam_step"], before[0]["adam_step"])


def _fails(rank: int, world: int, *_: object) -> None:
    if rank == 1:
        raise RuntimeError("replica 1 broke")


def test_a_failing_replica_is_reported():
    with pytest.raises(RuntimeError, match="replicas exited"):
        run_group(_fails, 2)


def _exit_unless(marker: str | None) -> str | None:
    """Exit the process (code 3) unless ``marker`` exists; create it first (so the next process
    lives). ``None``: always exit."""
    if marker is None or not os.path.exists(marker):
        if marker is not None:
            open(marker, "w").close()
        os._exit(3)
    return marker


class _DiesInTheReplica:
    """An argument a replica cannot take: unpickling it in the spawned process exits that
    process before it reaches the group, as a replica killed (or out of memory) at start-up;
    with ``marker``, only the first replica that unpickles it."""

    def __init__(self, marker: str | None = None) -> None:
        self.marker = marker

    def __reduce__(self):
        return (_exit_unless, (self.marker,))


def test_a_group_that_did_not_form_is_formed_again(tmp_path):
    marker = str(tmp_path / "replica-died-once")
    run_group(
        _average_and_save,
        2,
        args=(str(tmp_path), _DiesInTheReplica(marker)),
        rank0_args=(str(tmp_path), None),
    )
    assert os.path.exists(marker)  # the first group did not form
    after = [load_file(tmp_path / f"rank{rank}.safetensors") for rank in range(2)]
    assert torch.equal(after[0]["params"], after[1]["params"])


def test_a_replica_that_dies_before_joining_fails_the_group_at_once():
    # Rank 0 used to wait for it in the rendezvous for torch's default 30 minutes; now each of
    # the two attempts to form the group ends when the replica's process does.
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="replica 1 exited with 3 before joining"):
        run_group(_fails, 2, args=(_DiesInTheReplica(),), rank0_args=(None,))
    assert time.monotonic() - started < 60


def _average_cpu_tensors(rank: int, world: int) -> None:
    StateAverager(_replica_state(rank))()


def test_fusion_on_a_machine_with_cuda_uses_gloo(monkeypatch):
    # On a GPU machine the group used to pick NCCL, which refuses CPU tensors (a CPU run there)
    # and two replicas on one GPU (device run on an H100: "Duplicate GPU detected"). CI has no
    # GPU: torch's answer is patched, the process group and its replicas are real.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    run_group(_average_cpu_tensors, 2)


ON_ONE_GPU = pytest.param(  # two replicas on one GPU: NCCL refused it (seen on an H100)
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ],
)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", ON_ONE_GPU])
def test_fused_learners_train_together(device: str):
    cfg = PPORunConfig.model_validate(
        {
            **preset("ppo", "CartPole-v1"),
            "learners": 2,
            "total_env_steps": 4096,
            "seed": 5,
            "device": device,
        }
    )
    result = train(cfg)
    # Rank 0 counts the steps of both replicas: 2 x 256 per update.
    assert [r["env_steps"] for r in result.history][:3] == [512, 1024, 1536]
    assert result.history[-1]["env_steps"] == 4096
    assert result.best is not None and result.best.mean > 0
