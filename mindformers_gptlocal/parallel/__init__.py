"""Parallel layout: the Layout reader, its rules, sharding strategies and recompute (pure Python but recompute.py)."""
