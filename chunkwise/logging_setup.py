"""One logging setup for both services.

`CHUNKWISE_LOG_LEVEL` (default INFO) and `CHUNKWISE_LOG_FORMAT`: `text` (default; one line per
record, `key=value` fields appended) or `json` (one JSON object per line, for log shippers).
Records about one request carry `extra={"request_id": ...}`, so they can be followed across
the scheduler's lines with a single filter.
"""

from __future__ import annotations

import json
import logging
import os
import time

# Attributes every LogRecord has; anything else was passed through `extra=` and is a field.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


def _fields(record: logging.LogRecord) -> dict:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


class TextFormatter(logging.Formatter):
    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = _fields(record)
        if extra:
            line += " " + " ".join(f"{k}={v}" for k, v in extra.items())
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            **_fields(record),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup_logging(level: str | None = None, fmt: str | None = None) -> None:
    level = (level or os.environ.get("CHUNKWISE_LOG_LEVEL", "INFO")).upper()
    fmt = (fmt or os.environ.get("CHUNKWISE_LOG_FORMAT", "text")).lower()
    if fmt not in ("text", "json"):
        raise ValueError(f"CHUNKWISE_LOG_FORMAT must be 'text' or 'json', got {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


class RepeatedLog:
    """Log a message that may repeat many times a second (a retry loop) once, then at most one
    summary line per `interval` seconds saying how often it repeated, until `reset()`.

    Repeats are keyed by `key`, so a different problem is logged at once."""

    def __init__(self, logger: logging.Logger, interval: float = 30.0, clock=time.monotonic):
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self._key: str | None = None
        self._since = 0.0
        self._repeats = 0

    def log(self, level: int, key: str, msg: str, *args) -> None:
        now = self._clock()
        if key != self._key:
            self._key, self._since, self._repeats = key, now, 0
            self._logger.log(level, msg, *args)
            return
        self._repeats += 1
        if now - self._since >= self._interval:
            self._logger.log(level, msg + " (repeated %d times in the last %.0f s)", *args, self._repeats,
                             now - self._since)
            self._since, self._repeats = now, 0

    def reset(self) -> None:
        self._key = None
