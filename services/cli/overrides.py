"""Layered configuration: defaults ← YAML file ← ``--set key.path=value`` overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from services.contracts.spec import read_yaml


class ConfigError(ValueError):
    """A config file or override that cannot be read; the message says where."""


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_yaml(path: Path) -> dict[str, Any]:
    try:
        data = read_yaml(path)
    except ValueError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping, not {type(data).__name__}")
    return data


def parse_set(assignment: str) -> dict[str, Any]:
    """``"ppo.learning_rate=1e-3"`` → ``{"ppo": {"learning_rate": 0.001}}`` (YAML scalars)."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects key=value, got {assignment!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {assignment!r}: value is not valid YAML ({exc})") from exc
    out: dict[str, Any] = {}
    node = out
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out
