"""`python -m executor_svc --model DIR --port P ...`: load the model and serve the Executor API."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import threading

from chunkwise import startup_heap
from chunkwise.cliutil import is_loopback
from chunkwise.limits import READY_EXECUTOR
from chunkwise.logging_setup import setup_logging
from chunkwise.model_source import resolve_model
from executor_svc.compute_loop import ComputeLoop
from executor_svc.config import ExecutorConfig

log = logging.getLogger("chunkwise.executor")


def check_security(config: ExecutorConfig) -> str:
    """Refuse to run without a token; warn when the token would cross a network in cleartext.
    Returns the token."""
    if not config.token:
        raise ValueError("a shared token is required (set CHUNKWISE_EXECUTOR_TOKEN, or --token): "
                         "the executor refuses every call without it")
    if not is_loopback(config.host) and not config.tls_cert_file:
        log.warning("listening on %s without TLS: the token and all traffic are readable on the network; "
                    "use --tls-cert-file/--tls-key-file unless the network is private", config.host)
    return config.token


def main(argv: list[str] | None = None) -> int:
    # Before torch is imported (the modules imported above do not import it): see startup_heap.
    startup_heap.pause_collection()
    setup_logging()
    try:
        parser = argparse.ArgumentParser(prog="python -m executor_svc", description="chunkwise executor")
        config = ExecutorConfig.from_namespace(ExecutorConfig.add_arguments(parser).parse_args(argv))
        if config.node_rank > 0:  # another host's tensor-parallel ranks: no API of its own
            from executor_svc.parallel import run_node

            config = dataclasses.replace(config, model=str(resolve_model(config.model)))
            log.info("tensor parallel host %d of %d: ranks meet at %s:%s", config.node_rank, config.nnodes,
                     config.master_addr, config.master_port)
            startup_heap.freeze_startup_heap("executor (this host's rank launcher)")  # it only waits on them
            return run_node(config)
        token = check_security(config)
        # The runner validates the config again with the resolved model directory.
        config = dataclasses.replace(config, model=str(resolve_model(config.model)))
    except (ValueError, FileNotFoundError) as e:
        print(f"executor_svc: error: {e}", file=sys.stderr)
        return 2
    from executor_svc.engine import ModelRunner  # torch: after pause_collection
    from executor_svc.server import build_server

    try:
        runner = ModelRunner(config)
    except (ValueError, FileNotFoundError) as e:
        # A model refused at load (unsupported architecture, a sliding window shorter than the
        # context, --max-model-len beyond the model's, missing tensors) is the user's input, not
        # a crash: one line and the flag-error exit code, like the checks above.
        print(f"executor_svc: error: {e}", file=sys.stderr)
        return 2
    compute = ComputeLoop()  # served by this (the main) thread below: it loaded the model
    server, port = build_server(runner, config.host, config.port, token, config.tls_cert_file,
                                config.tls_key_file, compute)
    server.start()
    info = runner.info
    log.info(
        "model %s (%s, %d params, %s on %s, attention %s)",
        info.model_path, info.architecture, info.num_parameters, info.dtype, info.device,
        info.attention_backend,
    )
    startup_heap.freeze_startup_heap("executor")
    # Launchers and tests read this line to learn the port when --port 0 was given.
    print(f"{READY_EXECUTOR} {config.host}:{port}", flush=True)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    compute.serve(stop)  # every handshake and step runs here until a signal sets `stop`
    log.info("shutting down")
    server.stop(grace=5).wait()
    runner.close()  # the other tensor-parallel ranks, if any
    return 0


if __name__ == "__main__":
    sys.exit(main())
