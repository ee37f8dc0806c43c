"""`python -m scheduler_svc --executor HOST:P --port Q ...`: serve the public Generation API."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import grpc

from chunkwise.logging_setup import setup_logging
from scheduler_svc.config import ServiceConfig
from scheduler_svc.engine import Engine
from scheduler_svc.executor_client import ExecutorClient
from scheduler_svc.server import build_server

log = logging.getLogger("chunkwise.scheduler")

READY_LINE = "chunkwise scheduler serving on"
SHUTDOWN_GRACE_SECONDS = 10.0


async def serve(config: ServiceConfig) -> int:
    executor = ExecutorClient(config.executor, config.token)
    engine = Engine(config, executor)
    try:
        await engine.start()
    except ValueError as e:  # configuration that only the handshake could check
        print(f"scheduler_svc: error: {e}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as e:
        print(f"scheduler_svc: error: executor {config.executor}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    server, port = await build_server(engine, config.host, config.port, config.api_keys)
    await server.start()
    if config.metrics_port is not None:
        metrics_port = engine.metrics.serve(config.metrics_host, config.metrics_port)
        print(f"chunkwise metrics on http://{config.metrics_host}:{metrics_port}/metrics", flush=True)
    print(f"{READY_LINE} {config.host}:{port}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: no new requests; %.0f s for running ones", SHUTDOWN_GRACE_SECONDS)
    await engine.stop(grace=SHUTDOWN_GRACE_SECONDS)
    await server.stop(grace=1.0)
    await executor.close()
    engine.metrics.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    config = ServiceConfig.from_args(argv)
    try:
        import uvloop

        return uvloop.run(serve(config))
    except ImportError:  # uvloop is not available on every platform; asyncio's loop works too
        return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
