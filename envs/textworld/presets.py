"""Difficulty presets: which generator makes a game and with which settings.

=============  ==========================  ==========================================  ============
preset         generator                   settings                                    expert steps
=============  ==========================  ==========================================  ============
``easy``       custom world (Python API)   1 room, 3 objects, quest length 1           1
``short``      custom world (Python API)   3 rooms, 6 objects, quest length 5          5
``simple``     ``tw-simple``               dense rewards, detailed goal                8-12
``coin``       ``tw-coin_collector``       level 10: a chain of 10 rooms               10
``coin25``     ``tw-coin_collector``       level 25: a chain of 25 rooms               25
``treasure``   ``tw-treasure_hunter``      level 15: 10 rooms, doors and containers    6
``cooking``    ``tw-cooking``              recipe 2, 6 rooms, open/cut/cook            10-11
``long``       ``tw-cooking``              recipe 3, 9 rooms, open/cut/cook            16-20
``xlong``      ``tw-cooking``              recipe 5, 12 rooms, open/cut/cook           32-49
=============  ==========================  ==========================================  ============

(Expert steps as measured on the tests' 20-game sample.)

Held-out evaluation: every split draws from seeds disjoint from the training seeds
(see ``tasks.py``); where a generator has its own held-out distribution, the eval split
uses it too (``tw-cooking --split test``: unseen foods and preparations; ``tw-simple
--test``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

CUSTOM = "custom"
SPLITS = {"train": 0, "eval": 1_000_000}  # first seed of each split: train and eval games never share a seed


def first_seed(split: str) -> int:
    if split not in SPLITS:
        raise ValueError(f"unknown TextWorld split {split!r}; expected one of {sorted(SPLITS)}")
    return SPLITS[split]



@dataclass(frozen=True)
class Preset:
    name: str
    generator: str  # "custom" (textworld.generator.make_game) or a tw-make challenge name
    settings: dict
    split_settings: dict[str, dict] = field(default_factory=dict)  # per-split overrides of ``settings``

    def settings_for(self, split: str) -> dict:
        return {**self.settings, **self.split_settings.get(split, {})}


def _cooking(name: str, recipe: int, rooms: int) -> Preset:
    settings = dict(recipe=recipe, take=recipe, go=rooms, open=True, cook=True, cut=True, drop=False,
                    recipe_seed=0, split="train")
    return Preset(name, "tw-cooking", settings, {"eval": {"split": "test"}})


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("easy", CUSTOM, dict(rooms=1, objects=3, quest_length=1)),  # make demo: a tiny model learns it on CPU
    Preset("short", CUSTOM, dict(rooms=3, objects=6, quest_length=5)),
    Preset("simple", "tw-simple", dict(rewards="dense", goal="detailed", test=False), {"eval": {"test": True}}),
    Preset("coin", "tw-coin_collector", dict(level=10)),
    Preset("coin2", "tw-coin_collector", dict(level=2)),
    Preset("coin3", "tw-coin_collector", dict(level=3)),
    Preset("coin25", "tw-coin_collector", dict(level=25)),  # the GPU learning bench: >= 20 expert turns
    Preset("treasure", "tw-treasure_hunter", dict(level=15)),
    _cooking("cooking", recipe=2, rooms=6),
    _cooking("long", recipe=3, rooms=9),
    _cooking("xlong", recipe=5, rooms=12),
)}
