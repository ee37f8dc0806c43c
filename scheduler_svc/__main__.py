"""`python -m scheduler_svc --executor HOST:P --port Q ...`: serve the public Generation API."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from chunkwise import startup_heap
from chunkwise.cliutil import is_loopback
from chunkwise.limits import READY_SCHEDULER
from chunkwise.logging_setup import setup_logging
from scheduler_svc.config import ServiceConfig

log = logging.getLogger("chunkwise.scheduler")


def _warn_if_exposed(config: ServiceConfig) -> None:
    if not is_loopback(config.host) and not config.tls_cert_file:
        log.warning("serving the public API on %s without TLS: prompts, outputs%s cross the network in "
                    "cleartext; use --tls-cert-file/--tls-key-file unless the network is private",
                    config.host, " and API keys" if config.api_keys else "")


async def serve(config: ServiceConfig) -> int:
    # gRPC, and torch and transformers with the tokenizer: imported after pause_collection (main).
    from scheduler_svc.engine import Engine
    from scheduler_svc.executor_client import ExecutorClient, ExecutorError
    from scheduler_svc.server import build_server

    _warn_if_exposed(config)
    executor = ExecutorClient(
        config.executor, config.token, tls_ca_file=config.executor_tls_ca_file,
        tls_server_name=config.executor_tls_server_name, step_timeout=config.executor_step_timeout,
    )
    try:
        engine = await Engine.connect(config, executor)
    except ValueError as e:  # configuration that only the handshake could check
        print(f"scheduler_svc: error: {e}", file=sys.stderr)
        return 2
    except ExecutorError as e:
        print(f"scheduler_svc: error: executor {config.executor}: {e}", file=sys.stderr)
        return 1
    engine.start()
    server, port = await build_server(
        engine, config.host, config.port, config.api_keys, config.tls_cert_file, config.tls_key_file
    )
    await server.start()
    if config.metrics_port is not None:
        metrics_port = engine.metrics.serve(config.metrics_host, config.metrics_port)
        print(f"chunkwise metrics on http://{config.metrics_host}:{metrics_port}/metrics", flush=True)
    startup_heap.freeze_startup_heap("scheduler")
    print(f"{READY_SCHEDULER} {config.host}:{port}", flush=True)

    stop = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():  # a second signal: do not wait out the grace period
            log.info("second signal: aborting running requests now")
            engine.hurry()
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await stop.wait()
    log.info("shutting down: no new requests; %.1f s for running ones", config.shutdown_grace)
    await engine.stop(grace=config.shutdown_grace)
    # The handlers still have to hand their last message (or error) to their clients.
    await server.stop(grace=1.0)
    await executor.close()
    engine.metrics.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    startup_heap.pause_collection()  # before serve() imports gRPC, torch and transformers
    setup_logging()
    config = ServiceConfig.from_args(argv)
    try:
        import uvloop
    except ImportError:  # uvloop is not available on every platform; asyncio's loop works too
        return asyncio.run(serve(config))
    return uvloop.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
