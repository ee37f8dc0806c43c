"""Fixtures for end-to-end tests: real executor and scheduler processes on loopback ports,
a tiny real checkpoint on disk, and transformers as the reference."""

from __future__ import annotations

import pytest

from e2e_helpers import Reference
from model_fixtures import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("e2e-tiny-llama"), "llama")


@pytest.fixture(scope="session")
def reference(tiny_llama_dir):
    return Reference(tiny_llama_dir)
