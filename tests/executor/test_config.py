"""ExecutorConfig: flags, environment variables, validation messages."""

from __future__ import annotations

import pytest

from executor_svc.config import ConfigError, ExecutorConfig


def parse(argv, env=None):
    return ExecutorConfig.from_args(argv, env=env or {})


def test_defaults():
    c = parse([])
    assert c == ExecutorConfig()
    assert (c.host, c.port, c.gpu_memory_utilization, c.kv_cache_space) == ("127.0.0.1", 50061, 0.9, 1.0)
    assert c.model is None and c.token is None and c.num_kv_blocks is None


def test_flags():
    c = parse(["--model", "/ckpt", "--dtype", "bfloat16", "--device", "cpu", "--num-kv-blocks", "128",
               "--gpu-memory-utilization", "0.5", "--kv-cache-space", "2.5", "--attention-backend", "torch",
               "--max-model-len", "4096", "--host", "0.0.0.0", "--port", "6000", "--token", "s3cret"])
    assert c == ExecutorConfig("/ckpt", "bfloat16", "cpu", 128, 0.5, 2.5, "torch", 4096, "0.0.0.0", 6000, "s3cret")
    assert c.resolved_dtype_name() == "bfloat16"


def test_environment_and_precedence():
    env = {"CHUNKWISE_MODEL": "/env", "CHUNKWISE_NUM_KV_BLOCKS": "64", "CHUNKWISE_PORT": "7000",
           "CHUNKWISE_DTYPE": "Float32", "CHUNKWISE_KV_CACHE_SPACE": "0.5",
           "CHUNKWISE_EXECUTOR_TOKEN": "from-env", "CHUNKWISE_TOKEN": "generic"}
    c = parse(["--port", "7001"], env)
    assert (c.model, c.num_kv_blocks, c.port, c.dtype, c.kv_cache_space) == ("/env", 64, 7001, "float32", 0.5)
    assert c.token == "generic"  # CHUNKWISE_TOKEN first, as the scheduler reads it
    assert parse([], {"CHUNKWISE_EXECUTOR_TOKEN": "from-env"}).token == "from-env"
    assert parse(["--token", "cli"], env).token == "cli"


def test_bad_env_value_names_the_variable():
    with pytest.raises(ConfigError, match=r"\$CHUNKWISE_PORT='http' is not a valid port"):
        parse([], {"CHUNKWISE_PORT": "http"})


def test_validation_lists_every_problem():
    with pytest.raises(ConfigError) as e:
        parse(["--num-kv-blocks", "0", "--gpu-memory-utilization", "1.5", "--port", "70000",
               "--kv-cache-space", "0", "--max-model-len", "0"])
    msg = str(e.value)
    for needle in ("--num-kv-blocks must be >= 1", "--gpu-memory-utilization must be in (0, 1]",
                   "--port must be in [0, 65535]", "--kv-cache-space must be > 0", "--max-model-len must be >= 1"):
        assert needle in msg


def test_env_choice_is_validated():
    with pytest.raises(ConfigError, match="--dtype must be one of"):
        parse([], {"CHUNKWISE_DTYPE": "int8"})


def test_bad_choice_on_the_command_line_exits():
    with pytest.raises(SystemExit):
        parse(["--dtype", "int8"])


def test_cpu_only_checks():
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks what happens without CUDA")
    assert parse(["--device", "auto"]).resolved_device() == "cpu"
    import executor_svc.config as config_module

    native = config_module.cpu_bf16_flags()
    assert parse([]).resolved_dtype_name() == ("bfloat16" if native else "float32")
    with pytest.raises(ConfigError, match="float16 is only supported on CUDA"):
        parse(["--dtype", "float16"])
    with pytest.raises(ConfigError, match="--device cuda was requested but torch sees no CUDA device"):
        parse(["--device", "cuda"])
    with pytest.raises(ConfigError, match="flash-attn needs a CUDA device"):
        parse(["--attention-backend", "flash-attn"])
    assert parse(["--attention-backend", "flex"]).attention_backend == "flex"  # runs on CPU too


def test_auto_dtype_follows_the_cpu_flags(tmp_path, monkeypatch):
    import torch

    import executor_svc.config as config_module

    if torch.cuda.is_available():
        pytest.skip("checks the CPU choice")
    with_bf16, without = tmp_path / "bf16", tmp_path / "plain"
    with_bf16.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile\n")
    without.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n")
    assert config_module.cpu_bf16_flags(str(with_bf16)) == ["avx512_bf16"]
    assert config_module.cpu_bf16_flags(str(without)) == []
    assert config_module.cpu_bf16_flags(str(tmp_path / "missing")) == []

    monkeypatch.setattr(config_module, "cpu_bf16_flags", lambda: ["amx_bf16"])
    assert parse([]).dtype_choice() == ("bfloat16", "auto: this CPU has native bf16 (amx_bf16)")
    monkeypatch.setattr(config_module, "cpu_bf16_flags", lambda: [])
    name, why = parse([]).dtype_choice()
    assert name == "float32" and "no native bf16" in why
    assert parse(["--dtype", "float32"]).dtype_choice() == ("float32", "--dtype float32")


def test_cpu_plain_weight_min_rows_flag_env_and_checks():
    assert parse([]).cpu_plain_weight_min_rows == 0  # one (packed) copy unless asked
    assert parse(["--cpu-plain-weight-min-rows", "0"]).cpu_plain_weight_min_rows == 0
    assert ExecutorConfig.from_args([], env={"CHUNKWISE_CPU_PLAIN_WEIGHT_MIN_ROWS": "256"}).cpu_plain_weight_min_rows == 256
    with pytest.raises(ConfigError, match="--cpu-plain-weight-min-rows must be >= 0, got -1"):
        parse(["--cpu-plain-weight-min-rows", "-1"])


def test_cpu_keep_freed_memory_flag_and_env():
    assert parse([]).cpu_keep_freed_memory is True
    assert parse(["--no-cpu-keep-freed-memory"]).cpu_keep_freed_memory is False
    assert parse(["--cpu-keep-freed-memory"], {"CHUNKWISE_CPU_KEEP_FREED_MEMORY": "0"}).cpu_keep_freed_memory is True
    assert ExecutorConfig.from_args([], env={"CHUNKWISE_CPU_KEEP_FREED_MEMORY": "off"}).cpu_keep_freed_memory is False


def test_enforce_eager_flag_and_env():
    assert parse([]).enforce_eager is False
    assert parse(["--enforce-eager"]).enforce_eager is True
    assert ExecutorConfig.from_args([], env={"CHUNKWISE_ENFORCE_EAGER": "1"}).enforce_eager is True
    assert ExecutorConfig.from_args([], env={"CHUNKWISE_ENFORCE_EAGER": "off"}).enforce_eager is False
    with pytest.raises(ConfigError, match="CHUNKWISE_ENFORCE_EAGER"):
        ExecutorConfig.from_args([], env={"CHUNKWISE_ENFORCE_EAGER": "maybe"})


def test_tls_flags_belong_to_the_config(tmp_path):
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("y")
    c = parse(["--tls-cert-file", str(cert)], {"CHUNKWISE_TLS_KEY_FILE": str(key)})
    assert (c.tls_cert_file, c.tls_key_file) == (str(cert), str(key))
    with pytest.raises(ConfigError, match="go together"):
        parse(["--tls-cert-file", str(cert)])
    with pytest.raises(ConfigError, match="--tls-key-file .* is not a readable file"):
        parse(["--tls-cert-file", str(cert), "--tls-key-file", str(tmp_path / "missing.pem")])


def test_tensor_parallel_flags():
    c = ExecutorConfig.from_args(["-tp", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                                  "--master-port", "29500"], env={})
    assert (c.tensor_parallel_size, c.nnodes, c.node_rank, c.master_addr, c.master_port) == (4, 2, 1, "10.0.0.1", 29500)
    assert ExecutorConfig.from_args([], env={"CHUNKWISE_TENSOR_PARALLEL_SIZE": "2"}).tensor_parallel_size == 2
    for args, message in (
        (["-tp", "0"], "--tensor-parallel-size must be >= 1"),
        (["-tp", "3", "--nnodes", "2", "--master-port", "1"], "must be a multiple of --nnodes 2"),
        (["-tp", "2", "--nnodes", "2", "--node-rank", "2", "--master-port", "1"], r"--node-rank must be in \[0, 2\)"),
        (["-tp", "2", "--nnodes", "2"], "needs --master-addr and --master-port"),
        (["--master-port", "70000"], r"--master-port must be in \[1, 65535\]"),
    ):
        with pytest.raises(ConfigError, match=message):
            ExecutorConfig.from_args(args, env={})


def test_tensor_parallel_gpus_are_counted_per_host(monkeypatch):
    # Each host runs tp / nnodes ranks, one GPU each: two hosts with one GPU serve -tp 2.
    import executor_svc.config as config_module
    from executor_svc.parallel import local_device_index

    monkeypatch.setattr(config_module, "_cuda_available", lambda: True)
    monkeypatch.setattr(config_module, "_cuda_device_count", lambda: 1)
    two_hosts = ["-tp", "2", "--nnodes", "2", "--master-port", "29500", "--device", "cuda", "--dtype", "bfloat16"]
    assert ExecutorConfig.from_args(two_hosts, env={}).tensor_parallel_size == 2
    with pytest.raises(ConfigError, match="puts 2 ranks on this host, one GPU each; torch sees 1"):
        ExecutorConfig.from_args(["-tp", "2", "--device", "cuda", "--dtype", "bfloat16"], env={})
    # The GPU a rank takes is its index among this host's ranks (worker_main's set_device).
    assert [local_device_index(r, 4, nnodes=2) for r in range(4)] == [0, 1, 0, 1]
    assert [local_device_index(r, 4) for r in range(4)] == [0, 1, 2, 3]
