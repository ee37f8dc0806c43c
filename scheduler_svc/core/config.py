"""Limits and feature switches of the scheduler core.

Two checks exist because two facts arrive at different times: `validate()` needs only the flags,
`validate_capacity()` needs the number of KV blocks, which the scheduler service learns from the
executor's handshake.
"""

from __future__ import annotations

from dataclasses import dataclass

from chunkwise.plan import cdiv


def _is_int(value: object) -> bool:
    # bool is an int subclass; `block_size=True` is a mistake, not the number 1.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(slots=True)
class SchedulerConfig:
    max_model_len: int  # longest prompt + output of one request, in tokens
    block_size: int = 16  # tokens per KV block; a power of two
    max_num_batched_tokens: int = 2048  # token budget of one step, shared by decodes and prefill chunks
    max_num_seqs: int = 256  # most requests running (holding KV) at once
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Allow the next step to be scheduled while one is in flight (two plans at most).
    async_scheduling: bool = False

    @property
    def max_plans_in_flight(self) -> int:
        return 2 if self.async_scheduling else 1

    def validate(self) -> None:
        """Raise ValueError naming every flag that is wrong, and why."""
        problems: list[str] = []
        for name in ("max_model_len", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be a bool, got {getattr(self, name)!r}")
        if problems:
            raise ValueError("invalid scheduler config: " + "; ".join(problems))

        if self.block_size & (self.block_size - 1):
            problems.append(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < self.block_size:
            # With prefix caching and chunked prefill a non-final chunk ends on a block boundary, so a
            # budget below one block could never make progress on a long prompt.
            problems.append(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least one block "
                f"(block_size = {self.block_size})"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            problems.append(
                f"without chunked prefill a whole prompt must fit one step, so max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len}); "
                f"raise the budget or enable chunked prefill"
            )
        if problems:
            raise ValueError("invalid scheduler config: " + "; ".join(problems))

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """KV blocks needed to hold `num_tokens` positions."""
        return cdiv(num_tokens, self.block_size)

    def validate_capacity(self, num_kv_blocks: int) -> None:
        """Raise ValueError unless the pool can hold one request of max_model_len tokens.

        That is the condition under which the scheduler can always make progress: by preempting
        everything newer, the oldest running request can always get the blocks it needs.
        """
        if not _is_int(num_kv_blocks) or num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be a positive integer, got {num_kv_blocks!r}")
        needed = self.blocks_for_tokens(self.max_model_len)
        if num_kv_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_kv_blocks} blocks of {self.block_size} tokens "
                f"({num_kv_blocks * self.block_size} tokens), but one request of max_model_len "
                f"({self.max_model_len}) tokens needs {needed} blocks; lower max_model_len to at most "
                f"{num_kv_blocks * self.block_size} or give the executor more KV memory"
            )
