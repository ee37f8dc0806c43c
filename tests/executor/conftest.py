"""Executor tests run torch single-threaded: the models are tiny, so threads only add
synchronisation cost, and on a shared CI machine a stalled worker thread turns millisecond
steps into tens of milliseconds."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _single_torch_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
