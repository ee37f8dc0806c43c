"""The SDK stays a client library: importing it pulls in none of the tools, the services or
torch, so an application that only sends requests installs and imports little."""

import subprocess
import sys


def test_sdk_imports_no_tool_service_or_torch():
    code = (
        "import sys, client, client.cli; "
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('chunkwise_tools', 'scheduler_svc', 'executor_svc', 'torch', 'transformers')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_tools_run_as_modules_and_through_the_chunkwise_command():
    for argv in (["-m", "chunkwise_tools.loadtest", "--help"], ["-m", "chunkwise_tools.serve", "--help"],
                 ["-m", "chunkwise_tools.soak", "--help"], ["-m", "client.cli", "bench", "--help"]):
        out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, (argv, out.stderr)
        assert "usage:" in out.stdout, argv
