"""Leaderboard service: the tournament's ranking of candidate agents (updater, generator, read
side), kept in Redis, with training files in a content-addressed checkpoint store."""
