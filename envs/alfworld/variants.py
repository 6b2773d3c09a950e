"""More ALFWorld training games from the same rooms: each train trial again with its objects put elsewhere.

Why: the shared archive holds 200 of the release's ~3.5k training games. A ~74M model learnt from scratch on their
expert episodes memorises them: on the H100 (2026-12-07) SFT reached 22% greedy wins on train games and a held-out
expert command loss of 0.68 nats/token against 0.07 on its own episodes, and won 1 of 128 held-out games. A game's
placement of objects is what the agent must search for; ``valid_seen`` is the release's same rooms with other
placements. A variant is such a game: every pickupable object of the trial moves to a receptacle of the same room
that the domain says can contain it (``canContain``, drawn from a seed of the variant's id, ``<trial id>#v<k>``), its
location with it; the room, the task and the goal stay (the goal's wording is drawn again, from the variant's id).
The package's hand-coded expert solved 18 of a 20-variant sample within 50 commands (the originals: 20 of 20; it
searches longer, 17 commands against 13): an unsolved variant is kept -- its SFT episode carries the expert's
search up to where it gave up, and under RL a game nobody wins has no advantage to learn from.

Objects that hold others or are held (``isReceptacleObject``, ``inReceptacleObject``) stay where they are.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

VARIANTS_BUILD = "relocate-1"  # how variants are drawn; in their folder's name
_FACT = re.compile(r"^(\s*)\((\w+)((?: [^\s()]+)+)\)\s*$")


def relocate_objects(problem: str, rng: random.Random) -> tuple[str, int]:
    """``problem`` (a trial's ``initial_state.pddl``) with every movable pickupable object in a receptacle drawn
    by ``rng`` among those of the room that can contain it. Returns the new problem and how many objects moved."""
    init, sep, goal = problem.partition("(:goal")
    if not sep:
        raise ValueError("an ALFWorld problem without a (:goal section")
    lines = init.split("\n")
    facts = [(i, m.group(2), m.group(3).split()) for i, line in enumerate(lines) if (m := _FACT.match(line))]
    recep_type = {a[0]: a[1] for _, f, a in facts if f == "receptacleType"}
    recep_at = {a[0]: a[1] for _, f, a in facts if f == "receptacleAtLocation"}
    obj_type = {a[0]: a[1] for _, f, a in facts if f == "objectType"}
    can = {(a[0], a[1]) for _, f, a in facts if f == "canContain"}
    pickupable = {a[0] for _, f, a in facts if f == "pickupable"}
    nested = ({a[0] for _, f, a in facts if f == "isReceptacleObject"}
              | {x for _, f, a in facts if f == "inReceptacleObject" for x in a[:2]})
    at_line = {a[0]: i for i, f, a in facts if f == "objectAtLocation"}
    receptacles = sorted(r for r in recep_type if r in recep_at)
    moved = 0
    for i, fact, args in facts:
        if fact != "inReceptacle":
            continue
        obj, recep = args[0], args[1]
        if obj not in pickupable or obj in nested or obj not in at_line or recep not in recep_type:
            continue
        options = [r for r in receptacles if (recep_type[r], obj_type.get(obj)) in can]
        if not options:
            continue
        new = rng.choice(options)
        moved += new != recep
        indent = _FACT.match(lines[i]).group(1)
        lines[i] = f"{indent}(inReceptacle {obj} {new})"
        lines[at_line[obj]] = f"{indent}(objectAtLocation {obj} {recep_at[new]})"
    return "\n".join(lines) + sep + goal, moved


def variant_problem(trial: Path, rng: random.Random) -> str:
    """The problem of a variant of ``trial``: its ``initial_state.pddl`` with the objects relocated by ``rng``."""
    return relocate_objects((trial / "initial_state.pddl").read_text(), rng)[0]
