"""The `chunkwise` command: `serve` (the local stack), `generate` (one request), `stats`."""

from __future__ import annotations

import argparse
import json
import sys


def _generate(ns) -> int:
    from client.sdk import ChunkwiseError, Client

    kwargs = dict(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                  top_k=ns.top_k, seed=ns.seed, stop=ns.stop or ())
    if ns.chat:
        kwargs["messages"] = [{"role": "user", "content": ns.prompt}]
    else:
        kwargs["prompt"] = ns.prompt
    try:
        with Client(ns.address, api_key=ns.api_key) as c:
            last = None
            for chunk in c.stream(**kwargs):
                print(chunk.text, end="", flush=True)
                last = chunk
            print()
            if last is not None and last.usage is not None:
                u = last.usage
                print(f"[finish={last.finish_reason} prompt={u.prompt_tokens} completion={u.completion_tokens} "
                      f"cached={u.cached_prompt_tokens}]", file=sys.stderr)
    except ChunkwiseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _stats(ns) -> int:
    from client.sdk import ChunkwiseError, Client

    try:
        with Client(ns.address, api_key=ns.api_key) as c:
            print(json.dumps(c.stats(), indent=2, sort_keys=True))
    except ChunkwiseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        from chunkwise_tools.serve import main as serve_main

        return serve_main(argv[1:])
    if argv[:1] == ["bench"]:
        from chunkwise_tools.loadtest import main as bench_main

        return bench_main(argv[1:], prog="chunkwise bench")
    p = argparse.ArgumentParser(prog="chunkwise")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("serve", help="start the local stack (see: chunkwise serve --help)")
    sub.add_parser("bench", help="load-test a running server (see: chunkwise bench --help)")
    g = sub.add_parser("generate", help="send one request and stream the text")
    g.add_argument("prompt")
    g.add_argument("--address", default="127.0.0.1:50051")
    g.add_argument("--api-key", default=None)
    g.add_argument("--chat", action="store_true", help="send the prompt as one user message")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append")
    s = sub.add_parser("stats", help="print the scheduler's counters")
    s.add_argument("--address", default="127.0.0.1:50051")
    s.add_argument("--api-key", default=None)
    ns = p.parse_args(argv)
    return {"generate": _generate, "stats": _stats}[ns.cmd](ns)


if __name__ == "__main__":
    sys.exit(main())
