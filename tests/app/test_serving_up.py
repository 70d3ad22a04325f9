"""`pdserve up` from the installed package: joins the session's Ray, serves, answers, stops cleanly;
a version given by a manifest (the README's form) serves too.

Serve is stopped before each test (conftest: a Ray test that runs Serve its own way), so it starts
here on fresh ports. With --prefill-replicas 0 the decode pool prefills locally.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampling_params import SamplingParams
from cluster.manifest import build_manifest
from cluster.tools.netutil import free_port

PDSERVE = str(Path(sys.executable).parent / "pdserve")


@contextmanager
def pdserve_up(env: dict, *argv: str):
    """`pdserve up ARGV` until it prints that it serves: yields its output lines (growing); then
    SIGINT, and it must stop cleanly (exit 0, "pdserve: stopped")."""
    proc = subprocess.Popen([PDSERVE, "up", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C to stop." in line:
                ready.set()
        ready.set()  # it exited: the wait below ends at once and says so

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(180) and proc.poll() is None, "pdserve up did not come up:\n" + "".join(lines[-40:])
        yield lines
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("pdserve up did not stop within 90 s of SIGINT")
    assert proc.returncode == 0, "".join(lines[-30:])
    assert "pdserve: stopped" in "".join(lines)


def generate(grpc_port: int, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([PDSERVE, "generate", "--address", f"127.0.0.1:{grpc_port}", *argv],
                          capture_output=True, text=True, timeout=120)


def test_pdserve_up_serves_and_stops_cleanly(ray_session, tiny_model):
    http_port, grpc_port = free_port(), free_port()
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    with pdserve_up(env, "--model", tiny_model, "--prefill-replicas", "0", "--num-blocks", "48",
                    "--http-port", str(http_port), "--grpc-port", str(grpc_port)) as lines:
        assert any(f"127.0.0.1:{grpc_port}" in line for line in lines)
        out = generate(grpc_port, "--prompt-token-ids", "256,11,12,13", "--max-tokens", "6", "--ignore-eos", "--json")
        assert out.returncode == 0, out.stderr
        expected = LLMEngine.from_model(tiny_model, num_blocks=48).generate(
            [[256, 11, 12, 13]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
        assert json.loads(out.stdout)["token_ids"] == expected.token_ids

        bad = generate(grpc_port, "--prompt", "", "--max-tokens", "3")
        assert bad.returncode == 2 and "INVALID_ARGUMENT: prompt: must be a non-empty string" in bad.stderr

        deadline = time.monotonic() + 30
        while True:  # replicas report their load once a second
            st = subprocess.run([PDSERVE, "status", "--json"], capture_output=True, text=True, timeout=60, env=env)
            assert st.returncode == 0, st.stderr
            status = json.loads(st.stdout)
            pools = sorted(s["role"] for s in status["replicas"].values() if s["age_s"] < 5)
            if pools == ["decode"]:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
        assert status["applications"]["pdserve"]["status"] == "RUNNING"
        assert set(status["applications"]["pdserve"]["deployments"]) == {"ingress", "decode"}
        # the app's one router (its model's) hears from the live replica through its feed
        [router] = [r for name, r in status["routers"].items() if name.startswith("pdserve/router/")]
        live = {rid for rid, s in status["replicas"].items() if s["age_s"] < 5}
        assert live <= {v["replica_id"] for v in router["feeds"]}, router
        assert [status["replicas"][rid]["router_feed"]["calls"] >= 1 for rid in live] == [True] * len(live)


def test_pdserve_up_serves_a_version_given_by_its_manifest(ray_session, tiny_model, tmp_path):
    """The README's form, `versions: {v1: {manifest: FILE}}`: deployed from the checkpoint the
    manifest pins, printed as served, answering with that version (it once answered, then failed
    printing what it serves: "its manifest is not resolved yet", exit 1)."""
    manifest = tmp_path / "tiny-v1.yaml"
    manifest.write_text(build_manifest(tiny_model, "tiny", "v1").to_yaml())
    config = tmp_path / "pdserve.yaml"
    config.write_text(f"models:\n  tiny:\n    versions:\n      v1: {{manifest: {manifest}}}\n")
    http_port, grpc_port = free_port(), free_port()
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    with pdserve_up(env, "--config", str(config), "--prefill-replicas", "0", "--num-blocks", "48",
                    "--http-port", str(http_port), "--grpc-port", str(grpc_port)) as lines:
        source = str(Path(tiny_model).resolve())
        assert f"pdserve is serving tiny@v1 ({source}), colocated (no prefill pool)\n" in lines
        out = generate(grpc_port, "--served-model", "tiny", "--prompt-token-ids", "256,11,12,13", "--max-tokens", "6",
                       "--ignore-eos", "--json")
        assert out.returncode == 0, out.stderr
        expected = LLMEngine.from_model(tiny_model, num_blocks=48).generate(
            [[256, 11, 12, 13]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
        assert json.loads(out.stdout)["token_ids"] == expected.token_ids
        pinned = generate(grpc_port, "--served-model", "tiny@v1", "--prompt-token-ids", "256,11", "--max-tokens", "2",
                          "--json")
        assert pinned.returncode == 0, pinned.stderr  # no keys: the one caller may pin
