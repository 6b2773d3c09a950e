"""Scripted multi-turn episodes on an engine: random environment turns, sampled assistant
turns, and whole-turn evictions chosen by a pattern. For parity tests and GPU studies
(the real agent loop lives in ``envs``)."""

from __future__ import annotations

import random
from collections.abc import Callable

Pattern = Callable[[list[tuple[int, int]], int], list[tuple[int, int]]]


def drop_oldest_half(turns, t):
    return turns[: len(turns) // 2] if t == 4 else []


def drop_one_oldest(turns, t):
    return turns[:1] if t >= 3 else []


def keep_chosen_subset(turns, t):
    return [turns[i] for i in (0, 2)] if t == 4 and len(turns) > 2 else []  # turns 1 and 3 are kept


def no_eviction(turns, t):
    return []


EVICTION_PATTERNS: dict[str, dict] = {
    "drop_oldest_half": dict(pattern=drop_oldest_half),
    "drop_one_oldest": dict(pattern=drop_one_oldest),
    "summary": dict(pattern=no_eviction, summary_at=4),
    "model_chosen_subset": dict(pattern=keep_chosen_subset),
}


def scripted_episode(eng, pattern: Pattern, *, turns: int = 7, seed: int = 0, summary_at: int | None = None,
                     first_len: int = 24, max_turn_tokens: int = 9, env_tokens: tuple[int, int] = (3, 12),
                     vocab: int = 256):
    """Run one episode on ``eng``; returns its ``StreamRecord``.

    Turn ``t``: evict the whole turns ``pattern(live_turns, t)`` names, sample an assistant
    message, append a random environment message. With ``summary_at``, an instruction is
    appended at that turn, the model writes a summary, and everything but the first
    message and the summary is evicted (Summary compaction's pattern).
    """
    rng = random.Random(seed)
    sid = eng.open_stream([rng.randrange(vocab) for _ in range(first_len)])
    live: list[tuple[int, int]] = []
    for t in range(turns):
        if summary_at == t:
            start = eng.ledger(sid).end
            eng.append(sid, [rng.randrange(vocab) for _ in range(6)], source="prompt")
            eng.generate(sid, max_new_tokens=8, seed=1000 + t)
            eng.evict(sid, [*live, (start, start + 6)])
            live = []
        for span in pattern(live, t):
            eng.evict(sid, [span])
            live.remove(span)
        start = eng.ledger(sid).end
        eng.generate(sid, max_new_tokens=rng.randint(2, max_turn_tokens), seed=seed * 100 + t)
        eng.append(sid, [rng.randrange(vocab) for _ in range(rng.randint(*env_tokens))])
        live.append((start, eng.ledger(sid).end - 1))  # the env turn's last token is still pending
    eng.generate(sid, max_new_tokens=4, seed=seed)
    record = eng.stream_record(sid)
    eng.close(sid)
    return record
