"""Which cached positions are attended through INT8 and which through INT4.

The rule, shared by the engine, the SGLang backend and ``single_decode``: a kept
logical position ``p`` of a sequence whose next position is ``end`` is *protected*
(INT8 side cache) iff ``p < sink`` (attention sinks) or ``p >= end - recent`` (the most
recent window, counted in logical positions, evicted ones included). Every other kept
position is attended through its INT4 entry. So each kept position is in exactly one
region, and eviction needs no rewrite: an evicted position vanishes from both lists.
"""

from __future__ import annotations

import torch


def protected_mask(positions: torch.Tensor, end: int, *, sink: int, recent: int) -> torch.Tensor:
    """Boolean mask over ``positions`` (kept logical positions): True = INT8 region."""
    return (positions < sink) | (positions >= end - recent)


def split_regions(length: int, *, sink: int, recent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``0..length-1`` of an uncompacted sequence -> (INT4 positions, INT8 positions)."""
    pos = torch.arange(length)
    prot = protected_mask(pos, length, sink=sink, recent=recent)
    return pos[~prot], pos[prot]
