"""``ServerArgs`` plus the kv-streams / kv4rl flags, and the combinations they need.

``--kv4rl`` stores the KV cache as KV4-RL (INT4 + INT8 side cache) through the ``kv4rl``
attention backend; ``--enable-kv-streams`` lets streaming sessions evict spans in place.
Both ride on SGLang settings that are switched on here (page size 1, streaming sessions,
no radix cache, no overlap scheduling) or refused with a message saying why.

CUDA graphs stay SGLang's defaults under ``--kv4rl``: decode steps are captured whole
("full"), prefill graphs are "breakable" (attention runs eagerly between captured segments).
Graph modes the backend does not implement are refused; graphs turned off by the user or by
one of SGLang's rules are reported with a warning, since every decode step is then eager.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

from sglang.srt.model_executor.cuda_graph_config import Backend
from sglang.srt.server_args import ServerArgs, add_attention_backend_choices

from .backend import BACKEND_NAME

add_attention_backend_choices([BACKEND_NAME])
logger = logging.getLogger(__name__)


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
        if self.kv4rl:
            self._check_kv4rl_graphs()

    def _check_kvstreams(self) -> None:
        if self.kv4rl_sink < 0 or self.kv4rl_recent < 0:
            raise ServerArgsError(f"--kv4rl-sink and --kv4rl-recent must be >= 0, got {self.kv4rl_sink}, "
                                  f"{self.kv4rl_recent}")
        if self.kv4rl:
            for field in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
                if getattr(self, field) not in (None, BACKEND_NAME):
                    raise ServerArgsError(f"--kv4rl runs its own attention backend in both phases; drop "
                                          f"--{field.replace('_', '-')} {getattr(self, field)}")
            if self.kv_cache_dtype not in ("auto", None):
                raise ServerArgsError(f"--kv4rl sets the KV format itself; drop --kv-cache-dtype {self.kv_cache_dtype}")
            if self.speculative_algorithm is not None:
                raise ServerArgsError("--kv4rl does not support speculative decoding")
            if self.enable_mixed_chunk:
                # a mixed batch (prefill + decode rows in one extend) is a forward mode the backend does not plan;
                # SGLang mixes only batches without logprobs, so the client's turns never mix, a plain request could
                raise ServerArgsError("--kv4rl does not support --enable-mixed-chunk")
            refused = {
                "--enable-torch-compile": (self.enable_torch_compile, "torch.compile would trace the backend's "
                                           "per-step planning and raw kernel launches"),
                "--enable-two-batch-overlap": (self.enable_two_batch_overlap, "the backend plans one batch per step"),
                "--enable-pdmux": (self.enable_pdmux, "prefill and decode would plan concurrently on two streams"),
                "--disaggregation-mode": (self.disaggregation_mode not in (None, "null"), "PD transfer moves "
                                          "model-dtype KV buffers, which the kv4rl pool does not have"),
                "--dllm-algorithm": (self.dllm_algorithm is not None, "diffusion decoding's forward mode is not "
                                     "supported"),
            }
            for flag, (on, why) in refused.items():
                if on:
                    raise ServerArgsError(f"--kv4rl does not support {flag}: {why}")
            self.attention_backend = BACKEND_NAME
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
        if self.kv4rl and not self.disable_radix_cache:
            # the INT8 side cache is per request row: a prefix matched in the radix tree (shared prompts, GRPO
            # siblings) would be read through this row's INT8 entries, which only the row that computed it wrote
            logger.warning("--kv4rl: turning the radix cache off: the INT8 side cache holds a request's sink and "
                           "recent positions in its own row, so a prefix shared from another request's row has no "
                           "INT8 copies there")
            self.disable_radix_cache = True

    def _check_kv4rl_graphs(self) -> None:
        """On the resolved CUDA-graph config: refuse the modes kv4rl does not implement, warn when
        graphs are off."""
        if self.device != "cuda":
            return
        decode, prefill = self.cuda_graph_config.decode.backend, self.cuda_graph_config.prefill.backend
        if decode not in (Backend.FULL, Backend.DISABLED):
            raise ServerArgsError(f"--kv4rl captures decode steps as full CUDA graphs; the {decode!r} decode graph "
                                  "backend is not supported (use the default 'full', or 'disabled')")
        if prefill not in (Backend.BREAKABLE, Backend.DISABLED):
            raise ServerArgsError(f"--kv4rl runs prefill attention eagerly: the prefill CUDA graph backend must be "
                                  f"'breakable' (the CUDA default) or 'disabled', not {prefill!r}")
        for phase, backend in (("decode", decode), ("prefill", prefill)):
            if backend == Backend.DISABLED:
                logger.warning("--kv4rl: %s CUDA graphs are disabled (by a flag or one of SGLang's rules): every "
                               "%s step plans and launches eagerly", phase, phase)

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
