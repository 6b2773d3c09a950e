"""A scripted engine client and environment for compaction and agent-loop tests.

The client has no model: generations come from a script, but the streams, slots and
evictions are the real ``StreamTable`` / ``StreamLedger`` ones, so live-KV accounting is what the engine's
would be. The environment answers every action with an observation of fixed length.
"""

from __future__ import annotations

from envs.rollout.protocol import StepResult, Task
from kvstreams_sglang.engine import Generation
from kvstreams_sglang.streams import StreamTable


class ScriptedClient:
    policy_version = 0

    def __init__(self, script, *, capacity: int = 1 << 20):
        self.script = script  # (sid, call_index, max_new_tokens) -> token ids
        self.table = StreamTable(capacity, 1024)
        self.calls: dict[int, int] = {}
        self.evictions: list[tuple[int, list]] = []  # (sid, spans) in call order

    async def open(self, stream):
        return self.table.open(stream).sid

    def ledger(self, sid):
        return self.table.get(sid).ledger

    async def append(self, sid, token_ids, source="env"):
        self.table.get(sid).ledger.append(token_ids, source)

    async def generate(self, sid, params):
        st = self.table.get(sid)
        st.commit(self.table.allocator.alloc(st.ledger.num_pending))
        n = self.calls.get(sid, 0)
        self.calls[sid] = n + 1
        out = list(self.script(sid, n, params.max_new_tokens))[: params.max_new_tokens]
        for i, tok in enumerate(out):
            st.ledger.add_sampled(tok, -1.0, 0)
            if i < len(out) - 1:
                st.commit(self.table.allocator.alloc(1))
        return Generation(out, [-1.0] * len(out), "stop" if out[-1] in params.stop_token_ids else "length")

    async def prefill(self, sid):
        st = self.table.get(sid)
        st.commit(self.table.allocator.alloc(st.ledger.num_pending))

    async def evict(self, sid, spans):
        self.evictions.append((sid, sorted(spans)))
        return self.table.evict(sid, spans)

    async def close(self, sid, **meta):
        record = self.table.get(sid).ledger.to_record(**meta)
        self.table.close(sid)
        return record


class FixedEnv:
    """Observations of ``obs_len`` ASCII characters (= tokens with the byte tokenizer)."""

    system_prompt = "You are a test agent."

    def __init__(self, obs_len: int = 20, steps: int = 10_000):
        self.obs_len, self.steps, self.t = obs_len, steps, 0

    def reset(self, task: Task) -> str:
        self.t = 0
        return "o" * self.obs_len

    def step(self, action: str) -> StepResult:
        self.t += 1
        done = self.t >= self.steps
        return StepResult("x" * self.obs_len, 1.0 if done else 0.0, done, {"won": done})

    def expert_action(self) -> str | None:
        return "go"

    def close(self) -> None:
        pass
