"""Access control: the executor requires the shared token (UNAUTHENTICATED without it) and listens
on 127.0.0.1 unless told otherwise; the public API takes optional API keys; both speak TLS with
certificates from files.

The certificates are self-signed and made here with the `openssl` command (the tests are skipped
where it is missing); each one is its own CA, with the names localhost and 127.0.0.1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import grpc
import pytest

from chunkwise.auth import bearer_metadata, channel_credentials
from chunkwise.v1 import executor_pb2 as pb
from chunkwise.v1 import executor_pb2_grpc as pb_grpc
from client import ChunkwiseError, Client
from chunkwise_tools.serve import READY_EXECUTOR, READY_SCHEDULER
from executor_svc.config import ExecutorConfig
from reliability_helpers import (
    SCHEDULER_FLAGS,
    assert_no_leak,
    call_code,
    free_port,
    health,
    launch_service,
    wait_idle,
)
from scheduler_svc.config import ServiceConfig

UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
PROMPT = [9, 8, 7, 6, 5, 4, 3, 100, 200, 300]
KEYS = ("key-one-" + "x" * 20, "key-two-" + "y" * 20)


def executor_stub(channel):
    return pb_grpc.ExecutorStub(channel)


# ---- the plaintext executor of the shared stack --------------------------------------------------

def test_executor_refuses_calls_without_the_token(shared):
    with grpc.insecure_channel(shared.executor_address) as ch:
        stub = executor_stub(ch)
        # Only calls that the interceptor refuses before the servicer: a real Initialize would
        # start a new epoch under the shared scheduler's feet.
        assert call_code(lambda: stub.Initialize(pb.InitializeRequest(block_size=16), timeout=10)) == UNAUTHENTICATED
        assert call_code(lambda: stub.Initialize(pb.InitializeRequest(block_size=16), timeout=10,
                                                 metadata=bearer_metadata("wrong"))) == UNAUTHENTICATED
        assert call_code(lambda: next(stub.StepStream(iter([pb.StepPlan(step_id=1)]), timeout=10,
                                                  metadata=(("authorization", shared.token),)))) == UNAUTHENTICATED
    # Health checks stay open for orchestrators.
    assert health(shared.executor_address, "chunkwise.v1.Executor") == "SERVING"
    with shared.client(timeout=60) as c:  # and the real scheduler was not disturbed
        c.generate(prompt_token_ids=PROMPT, max_tokens=4, temperature=0)
        assert_no_leak(wait_idle(c))


def test_loopback_by_default_and_token_required(model_dir):
    assert ExecutorConfig().host == "127.0.0.1"
    assert ServiceConfig().host == "127.0.0.1"
    env = {k: v for k, v in os.environ.items() if k not in ("CHUNKWISE_EXECUTOR_TOKEN", "CHUNKWISE_TOKEN")}
    r = subprocess.run([sys.executable, "-m", "executor_svc", "--model", str(model_dir), "--port", "0"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    assert "token is required" in r.stderr


# ---- a TLS stack with API keys ---------------------------------------------------------------------

def make_cert(directory, name: str) -> tuple[str, str]:
    cert, key = str(directory / f"{name}.pem"), str(directory / f"{name}.key")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", key, "-out", cert, "-days", "2", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key


@pytest.fixture(scope="module")
def tls_stack(model_dir, tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    d = tmp_path_factory.mktemp("tls")
    cert, key = make_cert(d, "server")
    other_ca, _ = make_cert(d, "other")
    token = "executor-token-" + "z" * 20
    exec_port = free_port()
    # No --host: the executor must pick loopback by itself.
    executor = launch_service(
        "executor_svc", ["--model", str(model_dir), "--dtype", "float32", "--port", str(exec_port),
                         "--num-kv-blocks", "48", "--tls-cert-file", cert, "--tls-key-file", key],
        READY_EXECUTOR, {"CHUNKWISE_EXECUTOR_TOKEN": token},
    )
    scheduler = None
    try:
        assert executor.address == f"127.0.0.1:{exec_port}"
        scheduler = launch_service(
            "scheduler_svc", ["--executor", executor.address, "--executor-tls-ca-file", cert, "--port", "0",
                              "--tls-cert-file", cert, "--tls-key-file", key, *SCHEDULER_FLAGS],
            READY_SCHEDULER, {"CHUNKWISE_EXECUTOR_TOKEN": token, "CHUNKWISE_API_KEY": ",".join(KEYS)},
        )
        yield dict(address=scheduler.address, executor=executor.address, ca=cert, other_ca=other_ca, token=token)
    finally:
        for proc in (scheduler, executor):
            if proc is not None and proc.alive():
                proc.popen.terminate()
                proc.popen.wait(30)


def test_api_key_required_over_tls(tls_stack, reference):
    address, ca = tls_stack["address"], tls_stack["ca"]
    assert health(address, credentials=channel_credentials(ca)) == "SERVING"  # open without a key
    for key in (None, "wrong-key"):
        with Client(address, api_key=key, tls_ca_file=ca, timeout=30, retry_timeout=0) as c:
            for call in (lambda: c.generate(prompt_token_ids=PROMPT, max_tokens=4), c.stats):
                with pytest.raises(ChunkwiseError) as info:
                    call()
                assert info.value.code == UNAUTHENTICATED
    for key in KEYS:
        with Client(address, api_key=key, tls_ca_file=ca, timeout=60) as c:
            r = c.generate(prompt_token_ids=PROMPT, max_tokens=8, temperature=0)
            reference.check(PROMPT, 8, r.token_ids)
            assert_no_leak(wait_idle(c))


def test_tls_is_enforced_and_verified(tls_stack):
    address = tls_stack["address"]
    # Plaintext against a TLS server, and TLS trusting the wrong CA: no connection at all.
    with Client(address, api_key=KEYS[0], timeout=10, retry_timeout=0) as c:
        with pytest.raises(ChunkwiseError) as info:
            c.stats()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
    with Client(address, api_key=KEYS[0], tls_ca_file=tls_stack["other_ca"], timeout=10, retry_timeout=0) as c:
        with pytest.raises(ChunkwiseError) as info:
            c.stats()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_tls_executor_requires_the_token(tls_stack):
    creds = channel_credentials(tls_stack["ca"])
    with grpc.secure_channel(tls_stack["executor"], creds) as ch:
        stub = executor_stub(ch)
        code = call_code(lambda: stub.Initialize(pb.InitializeRequest(block_size=16), timeout=10))
        assert code == UNAUTHENTICATED
    with grpc.insecure_channel(tls_stack["executor"]) as ch:
        code = call_code(lambda: executor_stub(ch).Initialize(pb.InitializeRequest(block_size=16), timeout=5))
        assert code == grpc.StatusCode.UNAVAILABLE
    assert health(tls_stack["executor"], "chunkwise.v1.Executor", credentials=creds) == "SERVING"
