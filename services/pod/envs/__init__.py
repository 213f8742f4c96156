"""Batched environments: the protocol (base.py), torch-native envs and adapters.

``make_env(name, num_envs, device, seed, **kwargs)`` builds any registered env by name.
"""

from services.pod.envs.base import TorchVecEnv, VecEnv
from services.pod.envs.registry import UnknownEnvError, list_envs, make_env

__all__ = ["TorchVecEnv", "UnknownEnvError", "VecEnv", "list_envs", "make_env"]
