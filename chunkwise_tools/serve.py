"""The one-command local stack: start executor_svc and scheduler_svc as child processes.

    python -m chunkwise_tools.serve [--model DIR|FILE.gguf|smollm2-135m-instruct] [--port 50051] [--demo]
        [--replicas N] [--gateway [--gateway-port 30080] [--gateway-policy cache_aware]]
        [-- scheduler flags ...]

Resolves the model once (converting the embedded GGUF on first use), generates a shared token,
starts the executor on a free loopback port, then the scheduler pointing at it, waits for both to
be healthy, prints the address and serves until Ctrl-C (or, with --demo, sends a few requests and
stops). `start_stack` is the same thing as a library call; the end-to-end tests use it.

With `--replicas N` it starts N such stacks; with `--gateway`, SMG in front of them
(chunkwise_tools/gateway.py), serving OpenAI-compatible HTTP on loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chunkwise.limits import READY_EXECUTOR, READY_SCHEDULER


class StackError(RuntimeError):
    pass


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    address: str
    log_lines: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait()

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM: the services drain, then exit); `wait_or_kill` collects it."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)

    def wait_or_kill(self, timeout: float) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()


def _pump(proc: subprocess.Popen, name: str, ready: str, found: dict, lines: list[str], echo) -> None:
    """Read a child's merged output: find the ready line, keep a tail, echo the rest."""
    for raw in proc.stdout:
        line = raw.rstrip("\n")
        lines.append(line)
        del lines[:-200]
        if ready in line and "address" not in found:
            found["address"] = line.split(ready, 1)[1].strip()
            found["event"].set()
        if echo is not None:
            echo(f"[{name}] {line}")
    found["event"].set()  # EOF: the process ended


def _parent_death_signal():
    """A preexec_fn that makes the child get SIGTERM when the process that started it dies, even
    by SIGKILL (Linux prctl PR_SET_PDEATHSIG), so a killed launcher leaves no orphans; None where
    that is not available. Only for children started from a thread that lives as long as the
    launcher: the signal fires when the *thread* that forked the child exits."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up now, not in the forked child
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the launcher died before the line above took effect
            os._exit(1)

    return preexec


def launch(name: str, cmd: list[str], ready: str, env: dict, timeout: float, echo=None,
           die_with_parent: bool = False, cwd: str | Path | None = None) -> Process:
    """`cmd` started (in `cwd`: `python -m` imports the code found there), once it printed `ready`."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd,
        start_new_session=True,  # Ctrl-C in the terminal goes to us; we stop the children
        preexec_fn=_parent_death_signal() if die_with_parent else None,
    )
    found: dict = {"event": threading.Event()}
    lines: list[str] = []
    threading.Thread(target=_pump, args=(proc, name, ready, found, lines, echo), daemon=True).start()
    try:
        became_ready = found["event"].wait(timeout)
    except BaseException:  # e.g. the launcher was told to stop while this child was starting
        proc.kill()
        proc.wait()
        raise
    if not became_ready or "address" not in found:
        proc.kill()
        proc.wait()
        tail = "\n".join(lines[-30:])
        raise StackError(f"{name} did not become ready within {timeout:.0f} s (exit {proc.returncode}):\n{tail}")
    return Process(name, proc, found["address"], lines)


def wait_healthy(address: str, service: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise StackError(f"{address} is not SERVING {service!r} after {timeout:.0f} s")
            time.sleep(0.1)


@dataclass
class Stack:
    executor: Process
    scheduler: Process
    token: str

    @property
    def address(self) -> str:
        return self.scheduler.address

    def stop(self, timeout: float = 15.0) -> None:
        for p in (self.scheduler, self.executor):
            p.terminate()
        for p in (self.scheduler, self.executor):
            p.wait_or_kill(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_executor(model_dir: str | Path, token: str, args: list[str] = (), *, env=None, timeout=300.0, echo=None,
                   die_with_parent: bool = False, cwd: str | Path | None = None) -> Process:
    env = dict(os.environ if env is None else env)
    env["CHUNKWISE_EXECUTOR_TOKEN"] = token  # through the environment: argv is visible to every user
    cmd = [sys.executable, "-m", "executor_svc", "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", "0", *args]
    proc = launch("executor", cmd, READY_EXECUTOR, env, timeout, echo, die_with_parent, cwd)
    try:
        wait_healthy(proc.address, "chunkwise.v1.Executor", timeout)
    except BaseException:
        proc.kill()
        raise
    return proc


def start_scheduler(executor_address: str, token: str, args: list[str] = (), *, host="127.0.0.1", port=0,
                    env=None, timeout=300.0, echo=None, die_with_parent: bool = False,
                    cwd: str | Path | None = None) -> Process:
    env = dict(os.environ if env is None else env)
    env["CHUNKWISE_EXECUTOR_TOKEN"] = token
    cmd = [sys.executable, "-m", "scheduler_svc", "--executor", executor_address,
           "--host", host, "--port", str(port), *args]
    proc = launch("scheduler", cmd, READY_SCHEDULER, env, timeout, echo, die_with_parent, cwd)
    try:
        wait_healthy(proc.address, "chunkwise.v1.Generation", timeout)
    except BaseException:
        proc.kill()
        raise
    return proc


def start_stack(model: str | None = None, *, executor_args: list[str] = (), scheduler_args: list[str] = (),
                host: str = "127.0.0.1", port: int = 0, timeout: float = 300.0, echo=None, env=None,
                die_with_parent: bool = False) -> Stack:
    from chunkwise.model_source import resolve_model

    model_dir = resolve_model(model)  # once, here, so the two children never convert concurrently
    token = secrets.token_urlsafe(24)
    executor = start_executor(model_dir, token, executor_args, env=env, timeout=timeout, echo=echo,
                              die_with_parent=die_with_parent)
    try:
        scheduler = start_scheduler(executor.address, token, scheduler_args, host=host, port=port,
                                    env=env, timeout=timeout, echo=echo, die_with_parent=die_with_parent)
    except BaseException:
        executor.kill()
        raise
    return Stack(executor, scheduler, token)


def run_demo(address: str) -> None:
    from client.sdk import Client

    question = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    with Client(address) as c:
        for attempt in ("first", "repeat"):
            print(f"\n--- demo request ({attempt}), streamed ---", flush=True)
            result = None
            for chunk in c.stream(messages=question, max_tokens=48, temperature=0):
                print(chunk.text, end="", flush=True)
                result = chunk
            print()
            u = result.usage
            print(f"finish={result.finish_reason} prompt_tokens={u.prompt_tokens} "
                  f"completion_tokens={u.completion_tokens} cached_prompt_tokens={u.cached_prompt_tokens}")
        st = c.stats()
        print(f"\nstats: steps={st['steps']} prefill_tokens={st['prefill_tokens']} "
              f"decode_tokens={st['decode_tokens']} prefix_cache_hits={st['prefix_cache_hits']}/"
              f"{st['prefix_cache_queries']} kv_blocks used/cached/free="
              f"{st['kv_blocks_used']}/{st['kv_blocks_cached']}/{st['kv_blocks_free']}")


def run_gateway_demo(url: str, model: str) -> None:
    from urllib.request import Request, urlopen

    body = {"model": model, "max_tokens": 48, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]}
    print(f"\n--- demo request through the gateway: POST {url}/v1/chat/completions ---", flush=True)
    req = Request(url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urlopen(req, timeout=120) as r:  # noqa: S310 (the loopback gateway we started)
        out = json.loads(r.read())
    print(out["choices"][0]["message"]["content"])
    print(f"usage: {json.dumps(out.get('usage'))}")


def _stop_on_signal(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(prog="python -m chunkwise_tools.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir, .gguf file or default model name")
    p.add_argument("--host", default="127.0.0.1", help="public API address")
    p.add_argument("--port", type=int, default=50051, help="public API port (0: any free one)")
    p.add_argument("--demo", action="store_true", help="send demo requests, print them, and stop")
    p.add_argument("--executor-arg", action="append", default=[], help="extra flag for executor_svc (repeatable)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus /metrics port of the scheduler (0: any free port; -1: off)")
    p.add_argument("--quiet", action="store_true", help="do not echo the services' logs")
    p.add_argument("--replicas", type=int, default=1,
                   help="scheduler+executor stacks to start (the first on --port, the others on free ports)")
    p.add_argument("--gateway", action="store_true",
                   help="start SMG in front of the replicas: OpenAI-compatible HTTP (needs the gateway extra)")
    p.add_argument("--gateway-host", default="127.0.0.1", help="the gateway's HTTP and metrics address")
    p.add_argument("--gateway-port", type=int, default=None, help="the gateway's HTTP port (default 30080)")
    p.add_argument("--gateway-policy", default="cache_aware", help="SMG's routing policy")
    ns = p.parse_args(argv)
    if not 1 <= ns.replicas <= 16:
        p.error(f"--replicas must be in [1, 16], got {ns.replicas}")
    if not ns.gateway and (ns.gateway_port is not None or ns.gateway_policy != "cache_aware"):
        p.error("--gateway-port and --gateway-policy need --gateway")
    # `docker stop`, systemd and a closed terminal send SIGTERM or SIGHUP, not Ctrl-C: stop the
    # children the same way (the finally below), never leave them running as orphans.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop_on_signal)
    echo = None if ns.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    print("starting chunkwise (model: %s) ..." % (ns.model or "embedded default"), flush=True)
    if ns.metrics_port >= 0 and "--metrics-port" not in extra:
        extra += ["--metrics-port", str(ns.metrics_port)]
    stacks: list[Stack] = []
    gateway = None
    try:
        try:
            for i in range(ns.replicas):
                stacks.append(start_stack(ns.model, executor_args=ns.executor_arg, scheduler_args=extra,
                                          host=ns.host, port=ns.port if i == 0 else 0, echo=echo,
                                          die_with_parent=True))
            if ns.gateway:
                from chunkwise.model_source import resolve_model
                from chunkwise_tools.gateway import DEFAULT_PORT, start_gateway

                gateway = start_gateway(
                    [s.address for s in stacks], resolve_model(ns.model), host=ns.gateway_host,
                    port=DEFAULT_PORT if ns.gateway_port is None else ns.gateway_port,
                    policy=ns.gateway_policy, echo=echo, die_with_parent=True)
        except (StackError, ValueError, FileNotFoundError) as e:
            print(f"serve: error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # stopped while starting: the finally stops what was started
            return 0
        for stack in stacks:
            print(f"chunkwise is serving on {stack.address} (gRPC chunkwise.v1.Generation, "
                  f"vllm.grpc.engine.VllmEngine)", flush=True)
            for line in stack.scheduler.log_lines:
                if "chunkwise metrics on" in line:
                    print(line, flush=True)
        if gateway is not None:
            print(f"OpenAI-compatible HTTP on {gateway.url}/v1 (SMG, policy {ns.gateway_policy}, model "
                  f"{gateway.model!r}); gateway metrics on {gateway.metrics_url}", flush=True)
        if ns.demo:
            run_demo(stacks[0].address)
            if gateway is not None:
                run_gateway_demo(gateway.url, gateway.model)
            return 0
        print("Ctrl-C to stop.", flush=True)
        while all(s.scheduler.alive() and s.executor.alive() for s in stacks) and (
                gateway is None or gateway.process.alive()):
            time.sleep(0.5)
        print("a service exited; stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        if gateway is not None:
            gateway.stop()
        for stack in stacks:
            stack.stop()


if __name__ == "__main__":
    sys.exit(main())
