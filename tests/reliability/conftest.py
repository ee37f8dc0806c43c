"""Fixtures for the reliability tests.

- `model_dir`: the tiny Llama checkpoint (tests/model_fixtures.py) plus a byte-level tokenizer
  with a chat template, so text paths can be exercised too.
- `reference`: transformers' greedy continuations on it (tests/e2e/e2e_helpers.Reference).
- `shared`: one live stack (executor + scheduler) shared by the tests that only need an ordinary
  server; each test leaves it idle, and checks that it is.
"""

from __future__ import annotations

import pytest

from e2e_helpers import Reference
from model_fixtures import make_tiny_checkpoint
from reliability_helpers import Deployment, add_byte_tokenizer

# 48 blocks of 16 tokens: enough for one 256-token request and a few more, so a burst of
# requests contends for KV (waiting, preemption) rather than all running at once.
SHARED_KV_BLOCKS = 48

@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("reliability-tiny-llama"), "llama")
    return add_byte_tokenizer(path)

@pytest.fixture(scope="session")
def reference(model_dir):
    return Reference(model_dir)

@pytest.fixture(scope="session")
def shared(model_dir):
    with Deployment(model_dir, ["--num-kv-blocks", str(SHARED_KV_BLOCKS)]).start() as dep:
        yield dep
