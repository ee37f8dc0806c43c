"""Constants both sides of a process boundary must agree on, defined once.

- The internal Executor API's message size cap (scheduler client and executor server). A step's
  plan and result are far below it; the public API has its own, smaller cap (scheduler_svc/server.py).
- The lines each service prints once it serves, followed by `HOST:PORT`: launchers (chunkwise_tools.serve,
  tests, docker healthchecks) read them to learn the port when `--port 0` was given.
"""

EXECUTOR_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

READY_EXECUTOR = "chunkwise executor serving on"
READY_SCHEDULER = "chunkwise scheduler serving on"
