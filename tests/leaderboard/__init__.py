"""Leaderboard service tests (real embedded Redis, real HTTP)."""
