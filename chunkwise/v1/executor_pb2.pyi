from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetEpochRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetEpochResponse(_message.Message):
    __slots__ = ("executor_epoch",)
    EXECUTOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    executor_epoch: str
    def __init__(self, executor_epoch: _Optional[str] = ...) -> None: ...

class InitializeRequest(_message.Message):
    __slots__ = ("block_size",)
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    def __init__(self, block_size: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_path", "architecture", "vocab_size", "max_model_len", "eos_token_ids", "dtype", "device", "attention_backend", "num_parameters", "decode_attention", "prefill_attention", "layer_ops")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    DECODE_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    LAYER_OPS_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: str
    attention_backend: str
    num_parameters: int
    decode_attention: str
    prefill_attention: str
    layer_ops: str
    def __init__(self, model_path: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., attention_backend: _Optional[str] = ..., num_parameters: _Optional[int] = ..., decode_attention: _Optional[str] = ..., prefill_attention: _Optional[str] = ..., layer_ops: _Optional[str] = ...) -> None: ...

class InitializeResponse(_message.Message):
    __slots__ = ("executor_epoch", "model", "block_size", "num_kv_blocks")
    EXECUTOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    executor_epoch: str
    model: ModelInfo
    block_size: int
    num_kv_blocks: int
    def __init__(self, executor_epoch: _Optional[str] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ...) -> None: ...

class ExecSamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "num_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    num_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., num_logprobs: _Optional[int] = ...) -> None: ...

class NewRequestData(_message.Message):
    __slots__ = ("req_id", "token_ids", "block_ids", "sampling")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: ExecSamplingParams
    def __init__(self, req_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[ExecSamplingParams, _Mapping]] = ...) -> None: ...

class RunningRequestDelta(_message.Message):
    __slots__ = ("req_id", "new_token_ids", "new_block_ids", "append_sampled")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    APPEND_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    append_sampled: bool
    def __init__(self, req_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., append_sampled: _Optional[bool] = ...) -> None: ...

class ScheduledChunk(_message.Message):
    __slots__ = ("req_id", "num_computed_tokens", "num_tokens", "kv_write_start", "sample")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_WRITE_START_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    num_computed_tokens: int
    num_tokens: int
    kv_write_start: int
    sample: bool
    def __init__(self, req_id: _Optional[str] = ..., num_computed_tokens: _Optional[int] = ..., num_tokens: _Optional[int] = ..., kv_write_start: _Optional[int] = ..., sample: _Optional[bool] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "executor_epoch", "finished_req_ids", "new_requests", "running", "chunks", "follows_step_id")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FOLLOWS_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    executor_epoch: str
    finished_req_ids: _containers.RepeatedScalarFieldContainer[str]
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequestData]
    running: _containers.RepeatedCompositeFieldContainer[RunningRequestDelta]
    chunks: _containers.RepeatedCompositeFieldContainer[ScheduledChunk]
    follows_step_id: int
    def __init__(self, step_id: _Optional[int] = ..., executor_epoch: _Optional[str] = ..., finished_req_ids: _Optional[_Iterable[str]] = ..., new_requests: _Optional[_Iterable[_Union[NewRequestData, _Mapping]]] = ..., running: _Optional[_Iterable[_Union[RunningRequestDelta, _Mapping]]] = ..., chunks: _Optional[_Iterable[_Union[ScheduledChunk, _Mapping]]] = ..., follows_step_id: _Optional[int] = ...) -> None: ...

class SampledTokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("req_id", "token_id", "logprob", "top_logprobs")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[SampledTokenLogprob]
    def __init__(self, req_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[SampledTokenLogprob, _Mapping]]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled", "execute_seconds", "error")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled: _containers.RepeatedCompositeFieldContainer[SampledToken]
    execute_seconds: float
    error: StepError
    def __init__(self, step_id: _Optional[int] = ..., sampled: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., execute_seconds: _Optional[float] = ..., error: _Optional[_Union[StepError, _Mapping]] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
