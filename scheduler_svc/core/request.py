"""A generation request as the scheduler tracks it, and what one step produced for it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Literal

from chunkwise.plan import SampledToken, SamplingParams

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "abort")


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, never admitted
    RUNNING = "running"  # holds KV blocks; may be scheduled
    PREEMPTED = "preempted"  # was running, lost its blocks, queued again for recompute
    FINISHED = "finished"  # done, for the reason in `finish_reason`


@dataclass(eq=False, slots=True)
class Request:
    req_id: str
    prompt_token_ids: list[int] = field(repr=False)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 16
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    cache_salt: str | None = None  # the prefix-cache extra key: only requests with equal salts share KV
    arrival_time: float = field(default_factory=time.monotonic)

    # ----- state, owned by the scheduler -----
    output_token_ids: list[int] = field(default_factory=list, init=False)
    # Positions [0, num_computed_tokens) of all_token_ids have KV, as reported by executed steps
    # (or served by the prefix cache). Advanced in Scheduler.update, never in schedule.
    num_computed_tokens: int = field(default=0, init=False)
    # Prompt tokens served from the cache at the first admission whose step ran (usage; a resume
    # after preemption or an executor restart does not change it once set).
    num_cached_tokens: int = field(default=0, init=False)
    block_ids: list[int] = field(default_factory=list, init=False)
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    finish_reason: FinishReason | None = field(default=None, init=False)
    num_preemptions: int = field(default=0, init=False)

    # ----- scheduler internals -----
    all_token_ids: list[int] = field(default_factory=list, init=False, repr=False)  # prompt + outputs
    block_hashes: list[bytes] = field(default_factory=list, init=False, repr=False)  # of full blocks, from token 0
    num_registered_blocks: int = field(default=0, init=False, repr=False)  # leading blocks already offered to the index
    num_computed_high_water: int = field(default=0, init=False, repr=False)  # most positions ever computed or cached
    ever_admitted: bool = field(default=False, init=False, repr=False)
    # Admitted, and the step with its admission chunk has not been reported executed yet.
    admission_pending: bool = field(default=False, init=False, repr=False)
    # The first admission's step ran: num_cached_tokens is final, later admissions are resumes.
    first_admission_committed: bool = field(default=False, init=False, repr=False)
    # What the executor holds for this request, so plans can be incremental.
    executor_has_state: bool = field(default=False, init=False, repr=False)
    num_tokens_sent: int = field(default=0, init=False, repr=False)
    num_blocks_sent: int = field(default=0, init=False, repr=False)
    scheduled_in_step: int = field(default=-1, init=False, repr=False)
    # Async scheduling (a step scheduled while the previous one is in flight). Positions
    # [0, num_scheduled_tokens) are computed or being computed by a step in flight (equal to
    # num_computed_tokens when none is); num_output_placeholders counts tokens that steps in flight
    # will sample, which the next chunk builds on without knowing them.
    num_scheduled_tokens: int = field(default=0, init=False, repr=False)
    num_output_placeholders: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.eos_token_ids = frozenset(self.eos_token_ids)
        self.stop_token_ids = frozenset(self.stop_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Every known token: prompt plus outputs."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)


@dataclass(slots=True)
class RequestOutput:
    """What one executed step produced for one request."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[SampledToken]  # the executor's SampledToken entries (logprobs when asked for)
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int  # usage: prompt_tokens
    num_output_tokens: int  # usage: completion_tokens; outputs so far, including new_token_ids
    num_cached_tokens: int  # usage: cached_prompt_tokens; prompt tokens served from the cache
