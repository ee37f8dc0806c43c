import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "scheduler_bench.py"


def test_scheduler_bench_runs_and_writes_json(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("scheduler_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    assert bench.main(["--steps", "3", "--running", "8", "--waiting", "40", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["scenario"] for r in results] == ["decode", "churn", "kv-pressure"]
    assert all(r["total_us_per_request"] > 0 for r in results)
    assert "us per scheduled request" in capsys.readouterr().out
