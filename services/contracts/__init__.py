"""Torch-free, Redis-free contracts shared by the orchestrator, leaderboard, pod and CLI.

Only pydantic models, value checks and pure functions live here, so any service imports it
without pulling in torch or a Redis client.
"""
