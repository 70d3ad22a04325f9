"""`pdserve up` from the installed package: joins the session's Ray, serves, answers, stops cleanly.

Runs after test_serving.py (which shuts Serve down), so Serve starts here on fresh ports. With
--prefill-replicas 0 the decode pool prefills locally.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from cluster.tools.netutil import free_port

PDSERVE = str(Path(sys.executable).parent / "pdserve")


def test_pdserve_up_serves_and_stops_cleanly(ray_session, tiny_model):
    http_port, grpc_port = free_port(), free_port()
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    proc = subprocess.Popen(
        [PDSERVE, "up", "--model", tiny_model, "--prefill-replicas", "0", "--num-blocks", "48",
         "--http-port", str(http_port), "--grpc-port", str(grpc_port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C to stop." in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(180), "pdserve up did not come up:\n" + "".join(lines[-40:])
        assert any(f"127.0.0.1:{grpc_port}" in line for line in lines)
        out = subprocess.run([PDSERVE, "generate", "--address", f"127.0.0.1:{grpc_port}",
                              "--prompt-token-ids", "256,11,12,13", "--max-tokens", "6", "--ignore-eos", "--json"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        expected = LLMEngine.from_model(tiny_model, num_blocks=48).generate(
            [[256, 11, 12, 13]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
        assert json.loads(out.stdout)["token_ids"] == expected.token_ids

        bad = subprocess.run([PDSERVE, "generate", "--address", f"127.0.0.1:{grpc_port}", "--prompt", "",
                              "--max-tokens", "3"], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "INVALID_ARGUMENT: prompt: must be a non-empty string" in bad.stderr

        deadline = time.monotonic() + 30
        while True:  # replicas report their load once a second
            st = subprocess.run([PDSERVE, "status", "--json"], capture_output=True, text=True, timeout=60, env=env)
            assert st.returncode == 0, st.stderr
            status = json.loads(st.stdout)
            pools = sorted(s["pool"] for s in status["replicas"].values() if s["age_s"] < 5)
            if pools == ["decode"]:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
        assert status["applications"]["pdserve"]["status"] == "RUNNING"
        assert set(status["applications"]["pdserve"]["deployments"]) == {"ingress", "decode"}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("pdserve up did not stop within 90 s of SIGINT")
    assert proc.returncode == 0, "".join(lines[-30:])
    assert "pdserve: stopped" in "".join(lines)
