"""Both log formats carry request ids and other fields passed with `extra=`."""

import dataclasses
import json
import logging
import re

import pytest

from chunkwise.logging_setup import JsonFormatter, TextFormatter, setup_logging


def _record(**extra):
    rec = logging.makeLogRecord({"name": "chunkwise.scheduler", "levelname": "INFO", "levelno": 20,
                                 "msg": "request %s", "args": ("finished",)})
    for k, v in extra.items():
        setattr(rec, k, v)
    return rec


def test_json_lines_have_fields():
    doc = json.loads(JsonFormatter().format(_record(request_id="r-1", completion_tokens=7)))
    assert doc["msg"] == "request finished"
    assert doc["request_id"] == "r-1" and doc["completion_tokens"] == 7
    assert doc["level"] == "INFO" and doc["logger"] == "chunkwise.scheduler"


def test_text_lines_append_key_values():
    line = TextFormatter().format(_record(request_id="r-2"))
    assert line.endswith("chunkwise.scheduler: request finished request_id=r-2")


def test_unknown_format_is_refused(monkeypatch):
    monkeypatch.setenv("CHUNKWISE_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match="CHUNKWISE_LOG_FORMAT"):
        setup_logging()


def test_an_executor_back_unusable_is_logged_once_then_summarised(caplog):
    # Issue 17: _reconnect retries every 0.2 s, and each retry used to log the same ERROR.
    from scheduler_svc.config import ServiceConfig
    from scheduler_svc.engine import Engine
    from chunkwise.plan import ExecutorInfo

    class _Executor:
        address = "127.0.0.1:1"

    now = [0.0]
    usable = ExecutorInfo(epoch="e", block_size=16, num_kv_blocks=64, model_path="m", architecture="a",
                          vocab_size=100, max_model_len=512, eos_token_ids=(1,), dtype="float32",
                          device="cpu", attention_backend="torch", num_parameters=0)
    engine = Engine(ServiceConfig(), _Executor(), usable)
    engine._unusable_log._clock = lambda: now[0]
    too_small = dataclasses.replace(usable, num_kv_blocks=2)
    with caplog.at_level(logging.ERROR, logger="chunkwise.scheduler"):
        for _ in range(5 * 60):  # a minute of retries, 5 a second
            assert engine._adopt(too_small) is not None
            now[0] += 0.2
    lines = [r.getMessage() for r in caplog.records if "came back unusable" in r.getMessage()]
    assert len(lines) == 2, lines  # the first, and one summary after 30 s
    assert re.search(r"repeated 1[45]\d times in the last 30 s", lines[1]), lines[1]
