"""Batched environments: the protocol (base.py), torch-native envs and adapters."""

from services.pod.envs.base import TorchVecEnv, VecEnv

__all__ = ["TorchVecEnv", "VecEnv"]
