"""The built-in engine's settings: one pydantic model, the one owner of them.

``Engine.from_config`` builds an engine from it; the harness's ``[inference]`` section extends it
(adding which engine to use and where), so a run's TOML sets these fields by the same names.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kv_dtype: Literal["bf16", "kv4rl"] = "bf16"
    sink: int = Field(16, ge=0, description="kv4rl: first positions kept in the INT8 side cache")
    recent: int = Field(128, ge=0, description="kv4rl: most recent positions kept in the INT8 side cache")
    kv_slots: int = Field(65536, ge=1, description="KV pool size, in token slots (all streams together)")
    max_streams: int = Field(256, ge=1, description="open streams at once (rows of the slot table and side cache)")
    max_context: int | None = Field(None, ge=1, description="live tokens one stream may hold (default: "
                                    "min(kv_slots, 65536))")
    max_prefill_tokens: int = Field(16384, ge=1, description="new tokens one extend step computes")
    batch_invariant: bool = Field(False, description="matmuls, norms and attention through batch-invariant kernels: "
                                  "a stream's logprobs do not depend on the streams batched with it. With bf16 KV "
                                  "and trainer.impl = 'invariant' the trainer's logprobs then equal the sampler's bit "
                                  "for bit, at some speed cost; with kv4rl the engine is the reference of SGLang's "
                                  "--kv4rl-batch-invariant (a run refuses it: the trainer cannot replay INT4 "
                                  "rounding)")
