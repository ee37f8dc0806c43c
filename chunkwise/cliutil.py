"""Command-line flags that can also be set from the environment.

Every flag `--some-flag` reads `CHUNKWISE_SOME_FLAG` as its default, so a container can be
configured with environment variables alone; a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import ipaddress
import os

ENV_PREFIX = "CHUNKWISE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def add_flag(parser: argparse.ArgumentParser, flag: str, **kwargs) -> argparse.Action:
    """`parser.add_argument(flag, **kwargs)` with the default taken from the environment."""
    name = env_name(flag)
    raw = os.environ.get(name)
    if raw is not None:
        action = kwargs.get("action")
        if action is argparse.BooleanOptionalAction or action in ("store_true", "store_false"):
            low = raw.strip().lower()
            if low not in _TRUE | _FALSE:
                parser.error(f"{name}={raw!r}: expected one of {sorted(_TRUE | _FALSE)}")
            kwargs["default"] = low in _TRUE
        elif kwargs.get("nargs") in ("*", "+") or action == "append":
            conv = kwargs.get("type", str)
            kwargs["default"] = [conv(v) for v in raw.split(",") if v]
        else:
            conv = kwargs.get("type", str)
            try:
                kwargs["default"] = conv(raw)
            except (TypeError, ValueError):
                parser.error(f"{name}={raw!r} is not a valid value for {flag}")
    help_text = kwargs.get("help", "")
    kwargs["help"] = f"{help_text} [env {name}]" if help_text != argparse.SUPPRESS else help_text
    if "default" in kwargs and kwargs["default"] is not None and "%(default)" not in kwargs["help"]:
        kwargs["help"] += " (default: %(default)s)"
    return parser.add_argument(flag, **kwargs)


def is_loopback(host: str) -> bool:
    """Whether `host` (an IP literal, bracketed IPv6 included, or "localhost") is this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
