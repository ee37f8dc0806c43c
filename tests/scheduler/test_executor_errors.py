"""gRPC stays at the edges: ExecutorClient turns status codes into its own errors, the engine
speaks in error kinds, and only the public services (through scheduler_svc/status.py) map those
kinds back to status codes."""

from __future__ import annotations

import ast
from pathlib import Path

import grpc
import pytest

from scheduler_svc.engine import ErrorKind
from scheduler_svc.executor_client import ExecutorRejected, ExecutorUnavailable, _executor_error

ROOT = Path(__file__).resolve().parents[2]


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize(
    "code, kind",
    [
        (grpc.StatusCode.UNAVAILABLE, ExecutorUnavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, ExecutorUnavailable),
        (grpc.StatusCode.FAILED_PRECONDITION, ExecutorUnavailable),  # a plan for an old epoch
        (grpc.StatusCode.CANCELLED, ExecutorUnavailable),
        (grpc.StatusCode.INVALID_ARGUMENT, ExecutorRejected),  # the executor refused the plan itself
        (grpc.StatusCode.INTERNAL, ExecutorRejected),
        (grpc.StatusCode.UNAUTHENTICATED, ExecutorRejected),
    ],
)
def test_status_codes_become_executor_errors(code, kind):
    err = _executor_error(_rpc_error(code, "step 7: chunk 0 is wrong"))
    assert type(err) is kind
    assert err.code == code.name and err.detail == "step 7: chunk 0 is wrong"
    assert str(err) == f"{code.name}: step 7: chunk 0 is wrong"


def test_every_error_kind_has_a_status():
    from scheduler_svc.status import STATUS_OF_KIND  # grpc: only the services' shared map

    assert set(STATUS_OF_KIND) == set(ErrorKind)


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_step_loop_does_not_import_grpc():
    assert "grpc" not in _imported_roots(ROOT / "scheduler_svc" / "engine.py")
