"""`python -m client.soak` runs against a live server and reports a clean run (a few seconds of it;
the documented soak is minutes long, see docs/reliability.md)."""

from __future__ import annotations

import json

from client import soak
from reliability_helpers import assert_no_leak, wait_idle


def test_soak_runs_clean_for_a_few_seconds(shared, tmp_path):
    out = tmp_path / "soak.json"
    rc = soak.main(["--address", shared.address, "--minutes", "0.1", "--concurrency", "4", "--seed", "7",
                    "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0, report
    assert report["requests_sent"] > 0 and report["blocks_leaked"] == 0 and not report["unexpected_errors"]
    with shared.client(timeout=60) as c:
        assert_no_leak(wait_idle(c))
