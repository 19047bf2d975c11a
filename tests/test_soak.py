"""`tools/soak.py` against the tiny model's server: mixed load, mid-stream disconnects and bad
inputs; nothing lost, nothing left running, memory flat."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from server_fixtures import pool_is_full, serving, tiny_engine  # noqa: F401 - fixture

SOAK = Path(__file__).resolve().parents[1] / "tools" / "soak.py"
REQUESTS = int(os.environ.get("JAXSERVE_SOAK_REQUESTS", "240"))   # more, by hand: a longer soak
RSS_GROWTH_MIB = 200   # measured: 240 requests grew this process by 67 MiB, 1,000 by 68


@pytest.mark.slow
def test_a_soak_loses_nothing_and_leaves_nothing_running(tiny_engine, tmp_path):
    report_path = tmp_path / "soak.json"
    with serving(tiny_engine) as server:
        run = subprocess.run([sys.executable, str(SOAK), "--url", server.url, "--requests", str(REQUESTS), "--concurrency",
                              "16", "--pid", str(os.getpid()), "--report", str(report_path)],
                             capture_output=True, text=True, timeout=600)
        report = json.loads(report_path.read_text()) if report_path.exists() else None
        assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
        assert report["failures"] == []
        endings = report["endings"]
        assert endings["complete"] > REQUESTS * 0.6 and endings["json error"] >= REQUESTS * 0.04
        assert endings.get("disconnected", 0) >= REQUESTS * 0.04
        assert not any(status.startswith("5") for status in report["statuses"])
        assert report["gauges_after"] == {"num_requests_running": 0.0, "num_requests_waiting": 0.0}
        assert report["rss_mib"]["after"] - report["rss_mib"]["before"] < RSS_GROWTH_MIB
    assert pool_is_full(tiny_engine)
