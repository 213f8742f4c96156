"""A pod granted GPUs it cannot use is refused at start (services.pod.runtime.gpu_check.py): the
message names the cause, a CPU build of torch or no visible device, with the real torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.pod.runtime.gpu_check import describe_gpu_problem, gpu_problem

ROOT = Path(__file__).resolve().parents[2]

NO_CUDA = not torch.cuda.is_available()


def test_a_pod_granted_no_gpus_is_never_refused() -> None:
    assert gpu_problem(0) is None
    assert describe_gpu_problem(0, "2.13.0+cpu", None, 0) is None


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine where torch sees no CUDA device")
def test_gpus_granted_where_this_torch_sees_none_are_refused_with_the_cause() -> None:
    message = gpu_problem(1)
    assert message is not None
    assert "1 GPU granted (PODIUM_GPUS=1)" in message and torch.__version__ in message
    if torch.version.cuda is None:  # a CPU build, as the -cpu pod image has
        assert "CPU build" in message and "-cpu" in message
    else:
        assert "sees no CUDA device" in message
    assert "2 GPUs granted" in (gpu_problem(2) or "")


def test_each_cause_has_its_own_message() -> None:
    cpu = describe_gpu_problem(1, "2.13.0+cpu", None, 0)
    assert cpu is not None and "2.13.0+cpu is a CPU build" in cpu and "TORCH_VARIANT=cu128" in cpu
    driver = describe_gpu_problem(4, "2.13.0+cu128", "12.8", 0)
    assert driver is not None and "sees no CUDA device" in driver and "driver" in driver
    assert "CPU build" not in driver


def test_fewer_devices_than_granted_is_accepted() -> None:
    # Time-slicing: several replicas of one physical GPU, device 0 is what the pod trains on.
    assert describe_gpu_problem(4, "2.13.0+cu128", "12.8", 1) is None


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA device")
def test_on_a_gpu_the_grant_is_accepted_and_a_hidden_device_refused() -> None:
    assert gpu_problem(1) is None
    # The same torch with the device hidden from the process, as a container without the
    # device or driver sees it.
    code = "from services.pod.runtime.gpu_check import gpu_problem; print(gpu_problem(1))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert "sees no CUDA device" in out, out
