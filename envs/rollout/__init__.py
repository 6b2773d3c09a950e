"""The rollout layer every environment shares: an episode is one KV stream.

``protocol`` (what an environment and a task are) -> ``chat`` (turns as token pieces) ->
``agent_loop`` (open, generate, step the environment, append, compact) over an
``client.EngineClient`` (the built-in engine or an SGLang server) -> ``StreamRecord``\\ s.
``compaction`` holds the strategies (Summary, Markovian Thinker / Pick, Sliding Window, full
context) and how they are executed (evicted in place, or re-prefilled).
"""
