"""Soak test: a mixed, partly misbehaving workload against a chunkwise stack for a few minutes.

    python -m chunkwise_tools.soak --minutes 3                      # starts a local stack (default model)
    python -m chunkwise_tools.soak --minutes 3 --kill-executor-every 45   # ... and SIGKILLs the executor
    python -m chunkwise_tools.soak --address 127.0.0.1:50051 --minutes 10  # an existing server

`--concurrency` workers each send requests back to back: text and chat prompts sharing prefixes
(so the prefix cache works), greedy, seeded and unseeded sampling, stop strings, logprobs; about a
third of them are cancelled at a random point (breaking out of the stream, an Abort by id, or a
short deadline), and a few are invalid on purpose. It reports requests served, errors by status
(expected and unexpected), outputs that changed between identical deterministic requests, and the
KV blocks still held once the server is idle (leaked). The exit status is 1 if anything
unexpected happened: an unexpected status, an inconsistent output, or a leaked block.

With `--kill-executor-every S` (local stack only) the executor is killed with SIGKILL every S
seconds and restarted on the same port; requests in flight must ride it out (the scheduler waits
--executor-wait-timeout, 120 s here, and recomputes them), so no error is expected from it.
With `--restart-scheduler-at S` the scheduler gets SIGTERM once, S seconds in, and is started again
on the same port: the requests it fails while it drains and is down (UNAVAILABLE) are expected
errors of that fault and counted apart.

The report gives, for each fault, the p50/p99 end-to-end latency of requests served in the minute
before and the minute after it, how often the waiting queue was seen non-empty, and, with
`--replay`, a replay of every deterministic request's longest output against the quiet stack once
the faults are over (the uninterrupted reference): mismatches there are unexpected.

Deterministic requests (temperature 0, or a seed) are expected to give the same tokens whenever
they are repeated, whatever ran next to them; that is the oracle here, since there is no
reference model in the loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import secrets
import signal
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from client.sdk import AsyncClient, ChunkwiseError, Client

TOPICS = [
    "the water cycle", "how a compiler works", "the history of Rome", "why the sky is blue",
    "photosynthesis", "the rules of chess", "how vaccines work", "the French revolution",
    "prime numbers", "how bread rises", "plate tectonics", "the speed of light",
]
PREFIXES = [
    "You are a concise assistant. Answer in two sentences.\n\nQuestion: Explain ",
    "Write a short paragraph for a ten-year-old about ",
    "List three surprising facts about ",
]


@dataclass
class Tally:
    sent: int = 0
    served: Counter = field(default_factory=Counter)  # finish reason -> count
    cancelled: Counter = field(default_factory=Counter)  # how -> count (break, abort, deadline)
    expected_errors: Counter = field(default_factory=Counter)  # status -> count
    unexpected: Counter = field(default_factory=Counter)  # status -> count
    unexpected_examples: list = field(default_factory=list)
    inconsistent: int = 0  # deterministic requests whose output changed on a repeat
    deterministic_repeats: int = 0
    tokens: int = 0
    executor_kills: int = 0
    scheduler_restarts: int = 0
    scheduler_down_s: list[float] = field(default_factory=list)  # SIGTERM -> the new one's ready line
    # Errors while the scheduler drained and restarted (expected of that fault), by status.
    scheduler_restart_errors: Counter = field(default_factory=Counter)
    finished_at: list = field(default_factory=list)  # (monotonic end, e2e seconds) of served requests
    faults: list = field(default_factory=list)  # (monotonic time, what)
    queue_samples: list = field(default_factory=list)  # num_waiting seen every few seconds
    replayed: int = 0
    replay_mismatches: int = 0
    started: float = 0.0

    def unexpected_total(self) -> int:
        return sum(self.unexpected.values()) + self.inconsistent + self.replay_mismatches


def plan_request(rng: random.Random, max_tokens_cap: int, text: bool) -> dict:
    """One request's SDK arguments plus what the soak will do with it ('action')."""
    kw: dict = {}
    topic, prefix = rng.choice(TOPICS), rng.choice(PREFIXES)
    if text:
        if rng.random() < 0.25:
            kw["messages"] = [{"role": "user", "content": prefix + topic + "."}]
        else:
            kw["prompt"] = prefix + topic + "."
    else:  # a server without a tokenizer: ids below 256 exist in any real vocabulary
        base = [rng.randrange(3, 256) for _ in range(24)]
        kw["prompt_token_ids"] = base + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 40))]
    kw["max_tokens"] = min(max_tokens_cap, rng.choice([1, 4, 16, 32, 64, 128]))
    mode = rng.random()
    if mode < 0.5:
        kw["temperature"] = 0.0
    elif mode < 0.8:
        kw.update(temperature=0.8, top_p=0.95, top_k=50, seed=rng.randrange(4))  # few seeds: repeats
    else:
        kw["temperature"] = 1.0
    if text and rng.random() < 0.2:
        kw["stop"] = [rng.choice([".", "\n", " the"])]
    if rng.random() < 0.1:
        kw["logprobs"] = 2
    r = rng.random()
    if r < 0.65:
        action = "read"
    elif r < 0.85:
        action = "break"
    elif r < 0.91:
        action = "abort"
    elif r < 0.96:
        action = "deadline"
    else:
        action = "invalid"
        bad = rng.choice([("top_p", 2.0), ("temperature", math.nan), ("max_tokens", 0), ("top_k", -5)])
        kw[bad[0]] = bad[1]
    return {"kw": kw, "action": action, "cancel_after": rng.randrange(0, 8),
            "deadline": rng.uniform(0.05, 0.5)}


def deterministic_key(kw: dict):
    """Requests that must produce the same tokens, up to where each stops: same prompt and
    sampling, greedy or seeded. max_tokens and stop strings only cut the output short, and
    logprobs do not change it, so they are left out (and outputs compared as prefixes)."""
    if kw.get("temperature") != 0.0 and "seed" not in kw:
        return None
    same = {k: v for k, v in kw.items() if k not in ("max_tokens", "stop", "logprobs")}
    return json.dumps(same, sort_keys=True, default=str)


class Soak:
    def __init__(self, address: str, args, client_kw: dict):
        self.address = address
        self.args = args
        self.client_kw = client_kw
        self.tally = Tally()
        self.outputs: dict[str, list[int]] = {}  # deterministic request -> its longest output
        self.requests: dict[str, dict] = {}  # deterministic key -> the request's SDK arguments
        self.scheduler_down = False  # set by the chaos task from SIGTERM until the new one serves

    def _unexpected(self, what: str, detail) -> None:
        self.tally.unexpected[what] += 1
        if len(self.tally.unexpected_examples) < 10:
            self.tally.unexpected_examples.append(f"{what}: {detail}")

    async def one(self, client: AsyncClient, rng: random.Random, index: int) -> None:
        req = plan_request(rng, self.args.max_tokens, not self.args.token_ids)
        kw, action, t = dict(req["kw"]), req["action"], self.tally
        if action == "abort":
            kw["request_id"] = f"soak-{index}-{secrets.token_hex(4)}"
        timeout = req["deadline"] if action == "deadline" else self.args.request_timeout
        t.sent += 1
        tokens, finish, chunks = [], None, 0
        began = time.monotonic()
        try:
            async for chunk in client.stream(timeout=timeout, **kw):
                tokens += chunk.token_ids
                finish = chunk.finish_reason or finish
                chunks += 1
                if chunks > req["cancel_after"]:
                    if action == "break":
                        break
                    if action == "abort":
                        action = "aborted"
                        await client.abort(kw["request_id"])
        except ChunkwiseError as e:
            expected = (action == "invalid" and e.code == grpc.StatusCode.INVALID_ARGUMENT) or (
                action == "deadline" and e.code == grpc.StatusCode.DEADLINE_EXCEEDED)
            if e.code == grpc.StatusCode.UNAVAILABLE and self.scheduler_down:
                t.scheduler_restart_errors[e.code.name] += 1
                await asyncio.sleep(0.2)  # do not spin on a closed port
            elif expected:
                t.expected_errors[e.code.name] += 1
            else:
                self._unexpected(e.code.name, f"{e.message} (action {action}, {kw})")
            return
        t.tokens += len(tokens)
        if action == "invalid":
            self._unexpected("OK for an invalid request", kw)
        elif action == "break" and finish is None:
            t.cancelled["break"] += 1
        elif finish == "abort":
            t.cancelled["abort"] += 1
        elif finish in ("stop", "length"):
            t.served[finish] += 1
            now = time.monotonic()
            t.finished_at.append((now, now - began))
            key = deterministic_key(req["kw"])
            if key is not None and action in ("read", "deadline"):
                self.requests.setdefault(key, req["kw"])
                seen = self.outputs.setdefault(key, tokens)
                if seen is not tokens:
                    t.deterministic_repeats += 1
                    n = min(len(seen), len(tokens))
                    if seen[:n] != tokens[:n]:
                        t.inconsistent += 1
                        self._unexpected("inconsistent output", kw)
                    elif len(tokens) > len(seen):
                        self.outputs[key] = tokens
        else:
            self._unexpected("stream ended without a finish reason", kw)

    async def worker(self, wid: int, stop_at: float) -> None:
        rng = random.Random(self.args.seed * 1000 + wid)
        async with AsyncClient(self.address, **self.client_kw) as client:
            index = 0
            while time.monotonic() < stop_at:
                await self.one(client, rng, wid * 1_000_000 + index)
                index += 1

    async def progress(self, started: float, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            await asyncio.sleep(min(30.0, max(0.1, stop_at - time.monotonic())))
            t = self.tally
            elapsed = time.monotonic() - started
            print(f"[{elapsed:6.0f} s] sent {t.sent}, served {sum(t.served.values())}, "
                  f"cancelled {sum(t.cancelled.values())}, expected errors {sum(t.expected_errors.values())}, "
                  f"unexpected {t.unexpected_total()}, {t.tokens / elapsed:.1f} tok/s", flush=True)

    async def sample_queue(self, stop_at: float) -> None:
        """Read num_waiting every few seconds (the soak is meant to keep the queue non-empty)."""
        async with AsyncClient(self.address, **self.client_kw) as client:
            while time.monotonic() < stop_at:
                await asyncio.sleep(5.0)
                if self.scheduler_down:
                    continue
                try:
                    self.tally.queue_samples.append((await client.stats())["num_waiting"])
                except ChunkwiseError:
                    pass  # the scheduler is restarting

    async def run(self, seconds: float, chaos=()) -> None:
        started = self.tally.started = time.monotonic()
        stop_at = started + seconds
        tasks = [self.worker(w, stop_at) for w in range(self.args.concurrency)]
        tasks.append(self.progress(started, stop_at))
        tasks.append(self.sample_queue(stop_at))
        tasks.extend(fault(stop_at) for fault in chaos)
        await asyncio.gather(*tasks)

    async def replay(self, limit: int) -> None:
        """Send each deterministic request once more on the quiet stack, for as many tokens as its
        longest output during the soak, and compare: the uninterrupted reference."""
        items = sorted(self.requests.items())[:limit]
        sem = asyncio.Semaphore(8)

        async def one(client: AsyncClient, key: str, kw: dict) -> None:
            seen = self.outputs[key]
            kw = {k: v for k, v in kw.items() if k not in ("stop", "logprobs")} | {"max_tokens": len(seen)}
            async with sem:
                result = await client.generate(timeout=self.args.request_timeout, **kw)
            self.tally.replayed += 1
            if result.token_ids != seen:
                self.tally.replay_mismatches += 1
                if len(self.tally.unexpected_examples) < 10:
                    self.tally.unexpected_examples.append(f"replay mismatch: {kw}")

        async with AsyncClient(self.address, **self.client_kw) as client:
            await asyncio.gather(*(one(client, key, kw) for key, kw in items))


def latency_around_faults(tally: Tally, window: float = 60.0) -> list[dict]:
    """p50/p99 end-to-end latency of requests served in the `window` seconds before and after
    each fault (each side cut at the neighbouring fault)."""
    def pct(values: list[float], q: float) -> float | None:
        if not values:
            return None
        values = sorted(values)
        return round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 1)

    out = []
    times = [t for t, _ in tally.faults]
    for i, (at, what) in enumerate(tally.faults):
        lo = max(at - window, times[i - 1] if i else -math.inf)
        hi = min(at + window, times[i + 1] if i + 1 < len(times) else math.inf)
        before = [e2e for end, e2e in tally.finished_at if lo <= end < at]
        after = [e2e for end, e2e in tally.finished_at if at <= end < hi]
        out.append({"fault": what, "at_s": round(at - tally.started, 1),
                    "before": {"n": len(before), "p50_ms": pct(before, 0.5), "p99_ms": pct(before, 0.99)},
                    "after": {"n": len(after), "p50_ms": pct(after, 0.5), "p99_ms": pct(after, 0.99)}})
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_idle(address: str, client_kw: dict, timeout: float = 60.0) -> dict:
    with Client(address, **client_kw) as c:
        deadline = time.monotonic() + timeout
        while True:
            st = c.stats()
            if (st["num_running"] == 0 and st["num_waiting"] == 0 and st["kv_blocks_used"] == 0) \
                    or time.monotonic() > deadline:
                return st
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    scheduler_extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, scheduler_extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m chunkwise_tools.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=3.0, help="how long to run (default 3)")
    p.add_argument("--address", default=None, help="an existing server; default: start a local stack")
    p.add_argument("--model", default=None, help="model for the local stack (default: the embedded one)")
    p.add_argument("--executor-arg", action="append", default=[], help="extra executor_svc flag (repeatable)")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent workers (default 16)")
    p.add_argument("--max-tokens", type=int, default=64, help="cap on max_tokens per request (default 64)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="deadline of ordinary requests (s)")
    p.add_argument("--kill-executor-every", type=float, default=0.0,
                   help="SIGKILL and restart the executor every this many seconds (local stack only)")
    p.add_argument("--restart-scheduler-at", type=float, default=0.0,
                   help="SIGTERM the scheduler this many seconds in and start it again on the same port "
                        "(local stack only)")
    p.add_argument("--replay", type=int, default=0, metavar="N",
                   help="after the soak, replay up to N deterministic requests on the quiet stack and "
                        "compare with their outputs during the soak (default 0: off)")
    p.add_argument("--token-ids", action="store_true", help="send token-id prompts (a server without tokenizer)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--tls-ca-file", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")
    args = p.parse_args(argv)
    if (args.kill_executor_every or args.restart_scheduler_at) and args.address:
        p.error("--kill-executor-every and --restart-scheduler-at need the local stack (no --address)")
    client_kw = {"api_key": args.api_key, "tls_ca_file": args.tls_ca_file}
    settle = min(30.0, 0.3 * args.minutes * 60)  # no fault this close to the end: let it recover

    executor = scheduler = None
    chaos = []
    state: dict = {}
    if args.address is None:
        from chunkwise.model_source import resolve_model
        from chunkwise_tools.serve import start_executor, start_scheduler

        model_dir = resolve_model(args.model)
        token = secrets.token_urlsafe(24)
        exec_port = free_port()
        exec_args = ["--port", str(exec_port), *args.executor_arg]
        print(f"starting a local stack on {model_dir} ...", flush=True)
        executor = start_executor(model_dir, token, exec_args)
        sched_args = ["--executor-wait-timeout", "120", "--stats-interval", "0", *scheduler_extra]
        sched_port = free_port()  # fixed, so that a restarted scheduler comes back where clients look
        scheduler = start_scheduler(executor.address, token, sched_args, port=sched_port)
        address = scheduler.address
        state.update(executor=executor, scheduler=scheduler)

        if args.kill_executor_every:
            async def kill_executor(stop_at: float) -> None:
                while True:
                    await asyncio.sleep(args.kill_executor_every)
                    if time.monotonic() + settle > stop_at:
                        return  # leave time for the last restart to settle
                    proc = state["executor"]
                    soak.tally.faults.append((time.monotonic(), "executor SIGKILL"))
                    proc.popen.send_signal(signal.SIGKILL)
                    proc.popen.wait()
                    soak.tally.executor_kills += 1
                    print(f"chaos: killed the executor (pid {proc.popen.pid}); restarting it", flush=True)
                    state["executor"] = await asyncio.to_thread(start_executor, model_dir, token, exec_args)

            chaos.append(kill_executor)

        if args.restart_scheduler_at:
            async def restart_scheduler(stop_at: float) -> None:
                await asyncio.sleep(args.restart_scheduler_at)
                if time.monotonic() + settle > stop_at:
                    return
                proc = state["scheduler"]
                soak.scheduler_down = True
                down_at = time.monotonic()
                soak.tally.faults.append((time.monotonic(), "scheduler SIGTERM + restart"))
                print(f"chaos: SIGTERM to the scheduler (pid {proc.popen.pid}); restarting it", flush=True)
                proc.popen.send_signal(signal.SIGTERM)
                await asyncio.to_thread(proc.popen.wait)
                state["scheduler"] = await asyncio.to_thread(
                    start_scheduler, executor.address, token, sched_args, port=sched_port)
                soak.tally.scheduler_restarts += 1
                soak.tally.scheduler_down_s.append(round(time.monotonic() - down_at, 2))
                # The clients' channels find the new process within their 1 s reconnect backoff;
                # calls failing UNAVAILABLE until then are still this fault's.
                await asyncio.sleep(3.0)
                soak.scheduler_down = False

            chaos.append(restart_scheduler)
    else:
        address = args.address

    soak = Soak(address, args, client_kw)
    started = time.monotonic()
    try:
        print(f"soak: {args.concurrency} workers against {address} for {args.minutes:g} min", flush=True)
        asyncio.run(soak.run(args.minutes * 60, chaos))
        elapsed = time.monotonic() - started
        st = wait_idle(address, client_kw)
        if args.replay:
            print(f"replaying up to {args.replay} deterministic requests on the quiet stack ...", flush=True)
            asyncio.run(soak.replay(args.replay))
            st = wait_idle(address, client_kw)
    finally:
        if scheduler is not None:
            proc = state["scheduler"]
            proc.popen.send_signal(signal.SIGTERM)
            proc.popen.wait(30)
        if executor is not None:
            proc = state["executor"]
            proc.popen.send_signal(signal.SIGTERM)
            proc.popen.wait(30)

    t = soak.tally
    leaked = st["kv_blocks_used"]
    report = {
        "seconds": round(elapsed, 1),
        "requests_sent": t.sent,
        "requests_served": dict(t.served),
        "requests_cancelled": dict(t.cancelled),
        "expected_errors": dict(t.expected_errors),
        "unexpected_errors": dict(t.unexpected),
        "unexpected_examples": t.unexpected_examples,
        "deterministic_repeats_checked": t.deterministic_repeats,
        "inconsistent_outputs": t.inconsistent,
        "tokens_received": t.tokens,
        "tokens_per_second": round(t.tokens / elapsed, 1),
        "executor_kills": t.executor_kills,
        "executor_restarts_seen": st["executor_restarts"],  # by the scheduler running at the end only
        "scheduler_restarts": t.scheduler_restarts,
        # The old one drains for up to --shutdown-grace, refusing new requests, then the new one starts.
        "scheduler_down_s": t.scheduler_down_s,
        "scheduler_restart_errors": dict(t.scheduler_restart_errors),
        "latency_around_faults": latency_around_faults(t),
        "queue_nonempty_fraction": round(sum(1 for n in t.queue_samples if n > 0) / len(t.queue_samples), 3)
        if t.queue_samples else None,
        "queue_waiting_median": sorted(t.queue_samples)[len(t.queue_samples) // 2] if t.queue_samples else None,
        "replayed": t.replayed,
        "replay_mismatches": t.replay_mismatches,
        "preemptions": st["preemptions"],
        "prefix_cache_hit_rate": round(st["prefix_cache_hits"] / st["prefix_cache_queries"], 3)
        if st["prefix_cache_queries"] else 0.0,
        "kv_blocks": {k: st[k] for k in ("kv_blocks_total", "kv_blocks_free", "kv_blocks_used", "kv_blocks_cached")},
        "running_after": st["num_running"],
        "waiting_after": st["num_waiting"],
        "blocks_leaked": leaked,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    ok = t.unexpected_total() == 0 and leaked == 0 and st["num_running"] == 0 and st["num_waiting"] == 0
    print("soak: OK" if ok else "soak: FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
