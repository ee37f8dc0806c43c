"""Both log formats carry request ids and other fields passed with `extra=`."""

import json
import logging

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
