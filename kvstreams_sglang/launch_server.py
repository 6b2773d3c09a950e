"""Serve a model with SGLang plus kv-streams / kv4rl.

    python -m kvstreams_sglang.launch_server --model-path PATH --kv4rl --enable-kv-streams [sglang flags]

All of SGLang's server flags work; ``--kv4rl [--kv4rl-sink 16 --kv4rl-recent 128]`` stores
the KV cache as KV4-RL and ``--enable-kv-streams`` makes streaming sessions KV streams in the
radix tree (``POST /kvstreams/open``, ``/kvstreams/evict``, see ``sglang_ext.http_routes``). Same process layout as
``sglang serve``: HTTP + tokenizer here, the scheduler (with our patches) and the
detokenizer in subprocesses.

Needs ``sglang==0.5.17``: ``pip install -e ".[sglang]"`` on a GPU box. Where SGLang does not
import (a CPU box, or a GPU box missing one of its CUDA packages) this says so in one line
(``INSTALL_HINT``) instead of a traceback.
"""

from __future__ import annotations

import os
import sys

INSTALL_HINT = ('GPU: pip install -e ".[sglang]" (sglang==0.5.17, CUDA torch 2.11); CPU, for tests only: make '
                'sglang-cpu, then PYTHONPATH=tests/sglang_cpu_shims and --device cpu')


def _no_sglang(e: ImportError | OSError) -> SystemExit:
    return SystemExit(f"launch_server: SGLang does not import here ({type(e).__name__}: {e}). {INSTALL_HINT}")


def launch_server(server_args) -> None:
    try:
        from sglang.srt.entrypoints import http_server
        from sglang.srt.entrypoints.engine import Engine
        from sglang.srt.server_args import PortArgs

        from .sglang_ext.http_routes import add_routes
        from .sglang_ext.scheduler import run_scheduler_process
    except (ImportError, OSError) as e:  # a missing package, or a CUDA library it cannot load
        raise _no_sglang(e) from None

    # http_server.launch_server with our scheduler process, and the port args made first: the routes need the
    # RPC socket's name
    port_args = PortArgs.init_new(server_args)
    add_routes(http_server.app, port_args.rpc_ipc_name)
    tokenizer_manager, template_manager, port_args, init_result, watchdog, _daemons = Engine._launch_subprocesses(
        server_args=server_args, init_tokenizer_manager_func=http_server.init_tokenizer_manager,
        run_scheduler_process_func=run_scheduler_process,
        run_detokenizer_process_func=http_server.run_detokenizer_process, port_args=port_args)
    http_server._setup_and_run_http_server(server_args, tokenizer_manager, template_manager, port_args,
                                           init_result.scheduler_infos, watchdog)


def main(argv: list[str] | None = None) -> None:
    try:
        from .sglang_ext.server_args import ServerArgsError, prepare_server_args
    except (ImportError, OSError) as e:  # a missing package, or a CUDA library it cannot load
        raise _no_sglang(e) from None

    try:
        server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    except ServerArgsError as e:
        sys.exit(f"launch_server: {e}")
    launch_server(server_args)


def _cpu_requested(argv: list[str]) -> bool:
    for i, a in enumerate(argv):
        if a == "--device=cpu" or (a == "--device" and argv[i + 1:i + 2] == ["cpu"]):
            return True
    return False


if __name__ == "__main__":
    if _cpu_requested(sys.argv[1:]):
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # read by SGLang at import time
    main()
