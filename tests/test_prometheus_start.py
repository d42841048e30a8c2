"""The Prometheus `llmserve up --prometheus-port` starts: it scrapes every cell's scheduler and
every worker; it refuses a port another server holds (which would answer as if it were ours);
and it dies with the process that started it, even by SIGKILL (no orphan holding the port)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmserve.prometheus import Prometheus, scrape_config, stack_targets
from llmserve.stack import StackSettings
from tests.stack_checks import wait_for
from tests.stacks import free_port

ROOT = Path(__file__).resolve().parent.parent
needs_prometheus = pytest.mark.skipif(
    not shutil.which("prometheus"), reason="prometheus is not installed: `make prometheus`"
)


def test_every_cells_scheduler_and_every_worker_is_a_target() -> None:
    """As the processes listen (llmserve/stack.py) and docker-compose.cells.yml publishes:
    gateway 9400, cell 0's scheduler 9401, workers 9402-9405, cell 1's scheduler 9406."""
    settings = StackSettings(cells=2, workers=2, metrics_base_port=9400)
    assert stack_targets(settings, host="h") == {
        "gateway": ["h:9400"],
        "scheduler": ["h:9401", "h:9406"],
        "worker": ["h:9402", "h:9403", "h:9404", "h:9405"],
    }
    assert settings.scheduler_metrics_port(1) == 9406


@needs_prometheus
def test_a_port_another_server_holds_is_refused(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        prometheus = Prometheus(scrape_config({}), tmp_path, port)
        with pytest.raises(OSError, match=f"port {port} is in use"):
            prometheus.start()
    assert prometheus.proc is None


@needs_prometheus
def test_it_dies_with_the_process_that_started_it(tmp_path) -> None:
    port = free_port()
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import time
            from pathlib import Path
            from llmserve.prometheus import Prometheus, scrape_config
            p = Prometheus(scrape_config({{}}), Path({str(tmp_path)!r}), {port})
            p.start()
            print(p.proc.pid, flush=True)
            time.sleep(600)
        """)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        pid = int(parent.stdout.readline())
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as f:  # a zombie (its parent, init, reaps it) is gone
            return f.read().split(")")[-1].split()[0] == "Z"

    try:
        wait_for(gone, 30, "prometheus stopped with its parent", period=0.2)
    finally:
        if not gone():
            os.kill(pid, signal.SIGKILL)
