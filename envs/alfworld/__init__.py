"""ALFWorld, text only (the real ``alfworld`` package on TextWorld's PDDL engine), offline.

- ``data.py``: finds the release data (``$ALFWORLD_DATA`` or the shared archive) and rebuilds
  each game with the installed package's logic (``python -m envs.alfworld.data``);
- ``worker.py``: player processes, kept and reused across episodes;
- ``env.py``: one game behind the environment protocol;
- ``tasks.py``: the task set (train / eval_seen / eval_unseen).
"""
