"""TextWorld games (the real ``textworld`` package, generated locally, played offline).

- ``presets.py``: the difficulties, from 5-step custom worlds to long cooking games;
- ``generate.py``: makes games and caches them by seed (``python -m envs.textworld.generate``);
- ``env.py``: plays one game behind the environment protocol;
- ``tasks.py``: the task set (train / held-out eval), generating missing games on first use;
- ``text.py``: commands out of model messages, compact observations out of game text.
"""
