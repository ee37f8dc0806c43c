"""Shared contract between chunkwise's scheduler and executor.

`chunkwise.plan` holds the plain dataclasses both services speak (`StepPlan`, `StepResult`);
`chunkwise.v1` holds the protobuf code generated from `proto/chunkwise/v1/*.proto`, and
`chunkwise.codec` converts between the two. Nothing here imports torch.
"""
