"""chunkwise's scheduler core: the KV block pool with prefix caching, and the step scheduler that
packs chunked prefills and decodes into one token budget. Plain Python: no torch, no grpc."""

from .block_pool import BlockHash, BlockPool, BlockRemoved, BlockStored, CacheCleared, KVBlock, KVEvent, hash_block_tokens
from .config import SchedulerConfig
from .request import FINISH_REASONS, FinishReason, Request, RequestOutput, RequestStatus
from .scheduler import Scheduler, SchedulerStats

__all__ = [
    "BlockHash",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheCleared",
    "FINISH_REASONS",
    "FinishReason",
    "KVBlock",
    "KVEvent",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "hash_block_tokens",
]
