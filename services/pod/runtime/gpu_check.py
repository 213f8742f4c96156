"""Refuse to train on the CPU when the pod was granted GPUs.

The orchestrator tells a pod how many GPUs it was granted in ``PODIUM_GPUS`` (both backends:
the Kubernetes one from the spec's ``resources.gpus`` beside the ``nvidia.com/gpu`` limit or
DRA claim, the local one with ``CUDA_VISIBLE_DEVICES`` beside it). A pod holding GPUs it cannot
use would train far slower on the CPU while the devices stay reserved for nobody, so it stops
at start (exit 2) and says why: a CPU build of torch in the image (the ``-cpu`` pod image on a
GPU node), or no device or driver in the container.

Fewer visible devices than granted is not refused: with the device plugin's time-slicing one
physical GPU may be granted as several replicas, and the pod trains on ``cuda`` (device 0).
"""

from __future__ import annotations


def gpu_problem(granted: int) -> str | None:
    """None when the pod can use the GPUs it was granted (or was granted none), else the reason,
    from what the installed torch reports."""
    if granted <= 0:
        return None
    # Imported here, not at module level: the check costs a CPU pod nothing to import.
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return describe_gpu_problem(granted, torch.__version__, torch.version.cuda, visible)


def describe_gpu_problem(
    granted: int, torch_version: str, cuda_build: str | None, visible: int
) -> str | None:
    """The decision itself. ``cuda_build`` is ``torch.version.cuda`` (None for a CPU build of
    torch); ``visible`` the CUDA devices torch can use."""
    if granted <= 0 or visible > 0:
        return None
    held = f"{granted} GPU{'s' if granted != 1 else ''} granted (PODIUM_GPUS={granted})"
    if not cuda_build:
        return (
            f"{held} but this image's torch {torch_version} is a CPU build: run GPU pods on the "
            "CUDA pod image (the release's podium-pod:<version>, not its -cpu tag, or an image "
            "built with TORCH_VARIANT=cu128), or request no GPUs"
        )
    return (
        f"{held} but torch {torch_version} (CUDA {cuda_build}) sees no CUDA device: no GPU or "
        "NVIDIA driver reached the container (the node needs the NVIDIA driver and container "
        "toolkit, or the GPU Operator; CUDA_VISIBLE_DEVICES must not hide the device)"
    )
