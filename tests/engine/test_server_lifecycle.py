"""The instance server's lifecycle: a client that leaves frees its blocks, a bad config exits with
status 2 and one line, SIGTERM stops the server and its engine-core process cleanly.

The last test stops the module's server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
from server_helpers import Server, cli, prompt
from testutil import assert_all_blocks_free, send_truncated_body


def test_client_disconnect_frees_blocks(server: Server):
    before = server.generated_tokens()
    with httpx.Client(timeout=30) as c:
        for _ in range(2):
            with c.stream(
                "POST",
                f"{server.url}/v1/completions",
                json={"prompt": prompt(50), "max_tokens": 900, "ignore_eos": True, "stream": True},
            ) as r:
                lines = r.iter_lines()
                got: list[str] = []
                for line in lines:
                    if line.startswith("data:"):
                        got.append(line)
                    if len(got) >= 3:
                        break
                assert len(got) == 3
    h = server.wait_idle()
    assert h["running"] == 0 and h["waiting"] == 0
    assert_all_blocks_free(h)
    # Aborted, not run to the end: far fewer than 2 x 900 tokens were generated.
    assert server.generated_tokens() - before < 900


def test_client_leaving_mid_body_is_not_a_server_error(server: Server):
    before = server.log.read_text()
    send_truncated_body(server.url, "/v1/completions")
    after = server.log.read_text()[len(before):]
    assert "Traceback" not in after and "Exception in ASGI" not in after, after
    assert server.health()["running"] == 0


def test_bad_config_exits_2(tmp_path: Path, llama_fp32: str):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"engine:\n  model: {{model: {llama_fp32}}}\n  cache: {{block_size: 7}}\n")
    r = subprocess.run(
        cli() + ["serve", "--config", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2
    assert "engine.cache.block_size" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_sigterm_exits_cleanly(server: Server):
    """Last test of the module: it stops the shared server."""
    children = _children(server.proc.pid)
    assert children, "the engine-core process should be a child of the server"
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=10) == 0, server.log.read_text()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in children if _alive(p)], "left-over child processes"
