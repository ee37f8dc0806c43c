"""Generated protobuf and gRPC code for chunkwise.v1 (see scripts/gen_proto.py)."""
