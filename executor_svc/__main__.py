"""`python -m executor_svc --model DIR --port P ...`: load the model and serve the Executor API."""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import threading

from chunkwise.logging_setup import setup_logging
from chunkwise.model_source import resolve_model
from executor_svc.config import ExecutorConfig
from executor_svc.engine import ModelRunner
from executor_svc.server import build_server

log = logging.getLogger("chunkwise.executor")

READY_LINE = "chunkwise executor serving on"


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    try:
        config = ExecutorConfig.from_args(argv)
        config = dataclasses.replace(config, model=str(resolve_model(config.model)))
        config.validate()
    except (ValueError, FileNotFoundError) as e:
        print(f"executor_svc: error: {e}", file=sys.stderr)
        return 2
    runner = ModelRunner(config)
    server, port = build_server(runner, config.host, config.port, config.token)
    server.start()
    info = runner.info
    log.info(
        "model %s (%s, %d params, %s on %s, attention %s)",
        info.model_path, info.architecture, info.num_parameters, info.dtype, info.device,
        info.attention_backend,
    )
    # Launchers and tests read this line to learn the port when --port 0 was given.
    print(f"{READY_LINE} {config.host}:{port}", flush=True)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("shutting down")
    server.stop(grace=5).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
