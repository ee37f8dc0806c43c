"""The engine's error kinds as a gRPC caller sees them: the one place they meet gRPC status codes,
shared by both public services (server.py's chunkwise.v1, vllm_api.py's VllmEngine)."""

import grpc

from scheduler_svc.engine import ErrorKind

STATUS_OF_KIND = {
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}
