"""Environments (TextWorld, ALFWorld, SWE-style tasks, a toy corridor) and the rollout layer they
share (``envs.rollout``: agent loop, engine client, chat rendering, compaction)."""
