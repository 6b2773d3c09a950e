"""``ServerArgs`` plus the kv-streams / kv4rl flags, and the combinations they need.

``--kv4rl`` stores the KV cache as KV4-RL (INT4 + INT8 side cache) through the ``kv4rl``
attention backend; ``--enable-kv-streams`` makes streaming sessions KV streams living in the
radix tree (``stream_cache``). Both ride on SGLang settings that are switched on here, before
``ServerArgs.__post_init__`` (its fields are read-only afterwards), or refused with a message
saying why. ``--enable-kv-streams`` switches on: page size 1, streaming sessions, the
``kvstreams`` radix cache backend, and the ``lpm`` schedule policy unless another than the default ``fcfs`` is given
(siblings with a cached prefix go first). It refuses: ``--disable-radix-cache``, another radix
cache backend, the session radix cache, the hierarchical cache, LMCache / FlexKV, speculative
decoding, DP attention, pipeline parallelism, and a page size other than 1 (the model kinds it
cannot serve, hybrid SWA / SSM / MLA / DSA, are refused when the cache is built).

CUDA graphs stay SGLang's defaults under ``--kv4rl``: decode steps are captured whole
("full"), prefill graphs are "breakable" (attention runs eagerly between captured segments).
``--cuda-graph-backend-prefill full`` (SGLang: experimental) captures whole prefill steps, attention
included (one graph per token bucket over fixed request slots; ``backend.PrefillGraphBuffers``): no
per-layer host work, the prefill step's bottleneck with breakable graphs.
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
from .hf_numerics import PARTS, HFNumericsError, parse_parts

STREAM_CACHE = "kvstreams"  # stream_cache.BACKEND_NAME (that module imports the scheduler's classes)

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
    hf_numerics: bool = False
    hf_numerics_parts: str = "all"
    kv4rl_batch_invariant: bool = False

    def __post_init__(self):
        self._check_kvstreams()
        super().__post_init__()
        if (self.kv4rl or self.enable_kv_streams) and self.page_size != 1:
            raise ServerArgsError(f"kv-streams and kv4rl evict and store single tokens, but the attention backend "
                                  f"{self.attention_backend} needs --page-size {self.page_size}")
        if self.kv4rl:
            self._check_kv4rl_graphs()
        if self.hf_numerics and self.device == "cuda" and Backend.TC_PIECEWISE in (
                self.cuda_graph_config.decode.backend, self.cuda_graph_config.prefill.backend):
            raise ServerArgsError("--hf-numerics does not support the 'tc_piecewise' CUDA graph backend: its "
                                  "torch.compile capture swaps the modules' forwards for SGLang's native ones")

    def _check_kvstreams(self) -> None:
        if self.kv4rl_sink < 0 or self.kv4rl_recent < 0:
            raise ServerArgsError(f"--kv4rl-sink and --kv4rl-recent must be >= 0, got {self.kv4rl_sink}, "
                                  f"{self.kv4rl_recent}")
        if self.kv4rl_batch_invariant and not self.kv4rl:
            raise ServerArgsError("--kv4rl-batch-invariant needs --kv4rl (its decode and extend plans; bf16 KV: "
                                  "SGLang's --enable-deterministic-inference)")
        if self.hf_numerics_parts != "all" and not self.hf_numerics:
            raise ServerArgsError("--hf-numerics-parts needs --hf-numerics")
        if self.hf_numerics:
            try:
                parse_parts(self.hf_numerics_parts)
            except HFNumericsError as e:
                raise ServerArgsError(str(e)) from None
            for bad, what in [(self.enable_torch_compile, "--enable-torch-compile (it swaps the modules' forwards "
                                                          "for SGLang's native ones)"),
                              (self.rl_on_policy_target is not None, "--rl-on-policy-target (SGLang's own alignment, "
                                                                     "with an fp32 residual stream)"),
                              (self.quantization is not None, f"--quantization {self.quantization}")]:
                if bad:
                    raise ServerArgsError(f"--hf-numerics does not support {what}")
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
                self.max_running_requests = 256  # sizes the INT8 side cache (kv4.cache.side_width slots per request)
        if self.kv4rl or self.enable_kv_streams:
            if self.page_size not in (None, 1):
                raise ServerArgsError(f"kv-streams and kv4rl evict and store single tokens: --page-size must be 1, "
                                      f"got {self.page_size}")
            self.page_size = 1
        if self.enable_kv_streams:
            refused = [(self.disable_radix_cache, "--disable-radix-cache (streams live in the radix tree)"),
                       (self.radix_cache_backend not in (None, STREAM_CACHE), f"--radix-cache-backend "
                        f"{self.radix_cache_backend} (streams need the {STREAM_CACHE!r} backend)"),
                       (self.enable_session_radix_cache, "--enable-session-radix-cache"),
                       (self.enable_hierarchical_cache, "--enable-hierarchical-cache"),
                       (self.enable_lmcache or self.enable_flexkv, "LMCache / FlexKV"),
                       (self.speculative_algorithm is not None, "speculative decoding"),
                       (self.enable_dp_attention, "--enable-dp-attention"),
                       (self.pp_size > 1, "pipeline parallelism (--pp-size > 1)")]
            for bad, what in refused:
                if bad:
                    raise ServerArgsError(f"--enable-kv-streams does not support {what}")
            self.enable_streaming_session = True  # SGLang's tokenizer refuses streaming sessions otherwise
            self.radix_cache_backend = STREAM_CACHE
            if self.schedule_policy == "fcfs":
                self.schedule_policy = "lpm"
        if self.kv4rl and not self.enable_kv_streams and not self.disable_radix_cache:
            # (KV streams handle this in their cache: a kv4rl stream computes its own prompt, stream_cache.)
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
        if prefill not in (Backend.BREAKABLE, Backend.FULL, Backend.DISABLED):
            raise ServerArgsError(f"--kv4rl's prefill attention runs eagerly between captured segments ('breakable', "
                                  f"the CUDA default) or inside whole captured steps ('full'); the {prefill!r} "
                                  "prefill CUDA graph backend is not supported")
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
                           help="KV streams: streaming sessions in the radix tree (a shared prefix, then a private "
                                "branch) with in-place span eviction (POST /kvstreams/open, /kvstreams/evict). "
                                "Agent turns share prefill steps with SGLang's own --enable-prefill-delayer "
                                "--prefill-delayer-queue-min-ratio R --prefill-delayer-max-delay-ms MS (overlap "
                                "scheduling stays on)")
        group.add_argument("--hf-numerics", action="store_true",
                           help="Qwen3's norms, RoPE, activation and merged projections round as Hugging Face "
                                "transformers rounds them in the model dtype (the built-in engine's and the trainer's "
                                "numerics) instead of SGLang's fused kernels: logprobs closer to the trainer's, "
                                "slower steps")
        group.add_argument("--kv4rl-batch-invariant", action="store_true",
                           help="with --kv4rl: a request's numerics do not depend on the requests batched with it: "
                                "bf16 GEMMs and the norms' row means through one fixed-tile Triton kernel "
                                "(kvstreams_sglang.kernels.batch_invariant), the decode kernels with a fixed split "
                                "count sized per request, extends unsplit at one tile. With --hf-numerics the "
                                "logprobs of a stream then follow the built-in engine's batch_invariant reference "
                                "whatever the scheduler batched; slower steps")
        group.add_argument("--hf-numerics-parts", default="all",
                           help=f"with --hf-numerics: which parts to align, 'all' or a comma list of "
                                f"{', '.join(PARTS)} (to tell which part carries a logprob gap, and its cost)")


def prepare_server_args(argv: list[str]) -> KVStreamsServerArgs:
    parser = argparse.ArgumentParser(prog="python -m kvstreams_sglang.launch_server")
    KVStreamsServerArgs.add_cli_args(parser)
    return KVStreamsServerArgs.from_cli_args(parser.parse_args(argv))
