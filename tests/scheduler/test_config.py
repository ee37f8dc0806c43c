import pytest

from scheduler_svc.core import Scheduler, SchedulerConfig


def test_defaults_are_valid():
    config = SchedulerConfig(max_model_len=4096)
    config.validate()
    assert (config.block_size, config.max_num_batched_tokens, config.max_num_seqs) == (16, 2048, 256)
    assert config.enable_prefix_caching and config.enable_chunked_prefill


@pytest.mark.parametrize("block_size", [3, 12, 24, 0, -16])
def test_block_size_must_be_a_power_of_two(block_size):
    with pytest.raises(ValueError, match="block_size"):
        SchedulerConfig(max_model_len=256, block_size=block_size).validate()


def test_budget_below_one_block_is_rejected_with_both_numbers():
    with pytest.raises(ValueError) as info:
        SchedulerConfig(max_model_len=256, block_size=16, max_num_batched_tokens=14).validate()
    message = str(info.value)
    assert "max_num_batched_tokens (14)" in message and "block_size = 16" in message


def test_budget_not_divisible_by_block_size_is_accepted():
    # Unlike the seed, which rejected chunk_size % block_size != 0.
    SchedulerConfig(max_model_len=256, block_size=16, max_num_batched_tokens=133).validate()


def test_without_chunked_prefill_a_whole_prompt_must_fit_the_budget():
    with pytest.raises(ValueError, match="chunked prefill"):
        SchedulerConfig(max_model_len=4096, max_num_batched_tokens=2048, enable_chunked_prefill=False).validate()
    SchedulerConfig(max_model_len=2048, max_num_batched_tokens=2048, enable_chunked_prefill=False).validate()


@pytest.mark.parametrize("field", ["max_model_len", "max_num_seqs", "max_num_batched_tokens"])
def test_non_positive_limits_are_rejected(field):
    kwargs = {"max_model_len": 256, field: 0}
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs).validate()


def test_bool_is_not_a_number():
    with pytest.raises(ValueError, match="block_size"):
        SchedulerConfig(max_model_len=256, block_size=True).validate()


def test_kv_capacity_must_hold_one_max_model_len_request():
    config = SchedulerConfig(max_model_len=1000, block_size=16)
    config.validate_capacity(63)  # ceil(1000 / 16) = 63
    with pytest.raises(ValueError, match="needs 63 blocks"):
        config.validate_capacity(62)
    with pytest.raises(ValueError, match="needs 63 blocks"):
        Scheduler(config, num_kv_blocks=62)


def test_scheduler_validates_its_config():
    with pytest.raises(ValueError, match="power of two"):
        Scheduler(SchedulerConfig(max_model_len=64, block_size=6), num_kv_blocks=100)
