"""``ServerArgs`` plus the kv-streams / kv4rl flags, and the combinations they need.

``--kv4rl`` stores the KV cache as KV4-RL (INT4 + INT8 side cache) through the ``kv4rl``
attention backend; ``--enable-kv-streams`` lets streaming sessions evict spans in place.
Both ride on SGLang settings that are switched on here (page size 1, streaming sessions,
no radix cache, no overlap scheduling) or refused with a message saying why.
"""

from __future__ import annotations

import argparse
import dataclasses

from sglang.srt.server_args import ServerArgs, add_attention_backend_choices

from .backend import BACKEND_NAME

add_attention_backend_choices([BACKEND_NAME])


class ServerArgsError(ValueError):
    """A flag combination kv-streams / kv4rl cannot run with."""


@dataclasses.dataclass
class KVStreamsServerArgs(ServerArgs):
    kv4rl: bool = False
    kv4rl_sink: int = 16
    kv4rl_recent: int = 128
    enable_kv_streams: bool = False

    def __post_init__(self):
        self._check_kvstreams()
        super().__post_init__()

    def _check_kvstreams(self) -> None:
        if self.kv4rl_sink < 0 or self.kv4rl_recent < 0:
            raise ServerArgsError(f"--kv4rl-sink and --kv4rl-recent must be >= 0, got {self.kv4rl_sink}, "
                                  f"{self.kv4rl_recent}")
        if self.kv4rl:
            if self.attention_backend not in (None, BACKEND_NAME):
                raise ServerArgsError(f"--kv4rl runs its own attention backend; drop --attention-backend "
                                      f"{self.attention_backend}")
            if self.kv_cache_dtype not in ("auto", None):
                raise ServerArgsError(f"--kv4rl sets the KV format itself; drop --kv-cache-dtype {self.kv_cache_dtype}")
            if self.speculative_algorithm is not None:
                raise ServerArgsError("--kv4rl does not support speculative decoding")
            if self.enable_mixed_chunk:
                raise ServerArgsError("--kv4rl does not support --enable-mixed-chunk")
            self.attention_backend = BACKEND_NAME
            self.disable_cuda_graph = True  # the kv4rl backend has no CUDA-graph capture path yet
            if self.max_running_requests is None:
                self.max_running_requests = 256  # sizes the INT8 side cache (sink + recent slots per request)
        if self.kv4rl or self.enable_kv_streams:
            if self.page_size not in (None, 1):
                raise ServerArgsError(f"kv-streams and kv4rl evict and store single tokens: --page-size must be 1, "
                                      f"got {self.page_size}")
            self.page_size = 1
        if self.enable_kv_streams:
            self.enable_streaming_session = True
            self.disable_radix_cache = True  # a session's row must be its own to compact
            self.disable_overlap_schedule = True  # overlap commits one extra token per turn into the row

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        ServerArgs.add_cli_args(parser)
        group = parser.add_argument_group("kvstreams")
        group.add_argument("--kv4rl", action="store_true",
                           help="KV4-RL KV cache: INT4 (4.25 bits/element) + INT8 sink/recent side cache")
        group.add_argument("--kv4rl-sink", type=int, default=16, help="first positions kept in INT8")
        group.add_argument("--kv4rl-recent", type=int, default=128, help="most recent positions kept in INT8")
        group.add_argument("--enable-kv-streams", action="store_true",
                           help="streaming sessions evict spans in place (POST /kvstreams/evict), keeping positions")


def prepare_server_args(argv: list[str]) -> KVStreamsServerArgs:
    parser = argparse.ArgumentParser(prog="python -m kvstreams_sglang.launch_server")
    KVStreamsServerArgs.add_cli_args(parser)
    return KVStreamsServerArgs.from_cli_args(parser.parse_args(argv))
