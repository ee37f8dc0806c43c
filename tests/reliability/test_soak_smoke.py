"""`python -m chunkwise_tools.soak` runs against a live server and reports a clean run (a few seconds of it;
the documented soak is minutes long, see docs/reliability.md)."""

from __future__ import annotations

import json

from chunkwise_tools import soak
from reliability_helpers import assert_no_leak, wait_idle


def test_soak_runs_clean_for_a_few_seconds(shared, tmp_path):
    out = tmp_path / "soak.json"
    rc = soak.main(["--address", shared.address, "--minutes", "0.1", "--concurrency", "4", "--seed", "7",
                    "--replay", "50", "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0, report
    assert report["requests_sent"] > 0 and report["blocks_leaked"] == 0 and not report["unexpected_errors"]
    assert report["replayed"] > 0 and report["replay_mismatches"] == 0
    with shared.client(timeout=60) as c:
        assert_no_leak(wait_idle(c))


def test_soak_restarts_the_scheduler_and_reports_latency_around_it(model_dir, tmp_path):
    # A local stack of its own (the fault kills its scheduler): SIGTERM 6 s into a 24 s soak.
    out = tmp_path / "soak.json"
    rc = soak.main(["--model", str(model_dir), "--minutes", "0.4", "--concurrency", "6", "--seed", "3",
                    "--restart-scheduler-at", "6", "--replay", "30", "--executor-arg=--dtype",
                    "--executor-arg=float32", "--json", str(out), "--", "--max-num-seqs", "3", "--shutdown-grace", "2"])
    report = json.loads(out.read_text())
    assert rc == 0, report
    assert report["scheduler_restarts"] == 1 and report["blocks_leaked"] == 0
    assert len(report["scheduler_down_s"]) == 1 and 0 < report["scheduler_down_s"][0] < 20
    (fault,) = report["latency_around_faults"]
    assert fault["fault"].startswith("scheduler SIGTERM") and 5 < fault["at_s"] < 9
    assert fault["before"]["n"] > 0 and fault["after"]["n"] > 0 and fault["after"]["p99_ms"] is not None
    assert report["queue_nonempty_fraction"] is not None and report["replay_mismatches"] == 0


def test_latency_around_faults_cuts_windows_at_the_neighbouring_fault():
    t = soak.Tally(started=100.0)
    t.faults = [(110.0, "a"), (130.0, "b")]
    t.finished_at = [(105.0, 0.1), (109.0, 0.2), (111.0, 1.0), (125.0, 0.5), (131.0, 0.3), (300.0, 9.0)]
    a, b = soak.latency_around_faults(t, window=60.0)
    assert a["at_s"] == 10.0 and a["before"]["n"] == 2 and a["after"]["n"] == 2  # cut at b
    assert a["after"]["p99_ms"] == 1000.0 and a["before"]["p50_ms"] == 200.0
    assert b["before"]["n"] == 2 and b["after"]["n"] == 1  # 300 s is outside b's minute
