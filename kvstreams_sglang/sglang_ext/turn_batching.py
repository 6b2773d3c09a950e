"""Turn batching: hold a prefill back for a few decode steps so that agent turns share prefill steps.

In a multi-turn agent rollout every stream's turn ends at its own decode step, and its next turn (an
observation of a few dozen tokens) arrives a few milliseconds later. SGLang runs a prefill step as soon
as one request waits, so with ~70 streams the GPU runs one prefill step per ~3 new turns, and each of
those steps costs about as much as a larger one (on an H200 with a 4B model: ~30 ms, host-bound by the
per-layer attention launches of the breakable prefill graph). SGLang's answer, ``--enable-prefill-delayer
--prefill-delayer-queue-min-ratio``, needs overlap scheduling, which ``--enable-kv-streams`` turns off.
This is the same rule for the non-overlap scheduler:

    hold (decode the running batch instead) while the waiting queue has fewer than
    ``ratio * running`` requests, at most ``max_delay_ms`` from the first held pass.

Nothing is held while no request runs, during a chunked prefill, or when the waiting requests already fill
every free request row. ``--kv-streams-turn-batch-ratio`` (0 = off, the default) and
``--kv-streams-turn-batch-max-delay-ms``; ``counters`` go into ``/kvstreams/pool_info``.
"""

from __future__ import annotations

import math
import time


class TurnBatcher:
    def __init__(self, ratio: float, max_delay_ms: float):
        self.ratio = ratio
        self.max_delay_s = max_delay_ms / 1000.0
        self.held_since: float | None = None
        self.counters = dict(turn_batch_held_passes=0, turn_batch_released_full=0, turn_batch_released_timeout=0)

    def hold(self, *, running: int, waiting: int, allocatable: int, chunked: bool) -> bool:
        """Whether this scheduler pass runs no prefill (the running batch decodes instead)."""
        if not self.ratio or not running or not waiting or chunked:
            self._release(None)
            return False
        want = min(max(1, math.ceil(self.ratio * running)), max(allocatable, 1))
        if waiting >= want:
            self._release("turn_batch_released_full")
            return False
        now = time.perf_counter()
        if self.held_since is None:
            self.held_since = now
        elif now - self.held_since >= self.max_delay_s:
            self._release("turn_batch_released_timeout")
            return False
        self.counters["turn_batch_held_passes"] += 1
        return True

    def _release(self, why: str | None) -> None:
        if self.held_since is not None and why is not None:
            self.counters[why] += 1
        self.held_since = None
