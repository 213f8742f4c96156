"""Learner fusion: parameter and optimiser-moment averaging across real processes (gloo)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from services.pod.config import PPORunConfig
from services.pod.training.fit import train
from services.pod.training.fusion import ParameterAverager, run_group
from services.pod.training.presets import preset


def _replica_state(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small net with rank-specific weights and one Adam step of rank-specific moments."""
    torch.manual_seed(100 + rank)
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    net(torch.randn(11, 5)).square().sum().backward()
    opt.step()
    return net, opt


def _tensors(net: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"param.{k}": v.detach().clone() for k, v in net.state_dict().items()}
    for i, p in enumerate(net.parameters()):
        out[f"exp_avg.{i}"] = opt.state[p]["exp_avg"].clone()
        out[f"exp_avg_sq.{i}"] = opt.state[p]["exp_avg_sq"].clone()
    return out


def _average_and_save(rank: int, world: int, directory: str) -> None:
    net, opt = _replica_state(rank)
    ParameterAverager(net, opt)()
    save_file(_tensors(net, opt), f"{directory}/rank{rank}.safetensors")


def test_two_processes_average_exactly(tmp_path):
    run_group(_average_and_save, 2, args=(str(tmp_path),))
    before = [_tensors(*_replica_state(rank)) for rank in range(2)]
    after = [load_file(tmp_path / f"rank{rank}.safetensors") for rank in range(2)]
    assert before[0].keys() == after[0].keys()
    for key in before[0]:
        expected = (before[0][key] + before[1][key]) / 2
        assert not torch.equal(before[0][key], before[1][key]), key  # the test has teeth
        # Bit-exact: a two-way sum then a halving is exact in IEEE arithmetic.
        assert torch.equal(after[0][key], expected), key
        assert torch.equal(after[1][key], expected), key


def _fails(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("replica 1 broke")


def test_a_failing_replica_is_reported():
    with pytest.raises(RuntimeError, match="replicas exited"):
        run_group(_fails, 2)


def _average_cpu_tensors(rank: int, world: int) -> None:
    net, opt = _replica_state(rank)
    ParameterAverager(net, opt)()


def test_fusion_on_a_machine_with_cuda_uses_gloo(monkeypatch):
    # On a GPU machine the group used to pick NCCL, which refuses CPU tensors (a CPU run there)
    # and two replicas on one GPU (device run on an H100: "Duplicate GPU detected"). CI has no
    # GPU: torch's answer is patched, the process group and its replicas are real.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    run_group(_average_cpu_tensors, 2)


ON_ONE_GPU = pytest.param(  # two replicas on one GPU: NCCL refused it (H100, session 10)
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
