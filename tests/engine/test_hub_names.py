"""A checkpoint by Hub name (`--model org/name`): huggingface_hub itself resolves it, from a cache laid
out as it lays one out (HF_HOME/hub/models--org--name: blobs, refs/main, snapshots/<commit>/ links),
offline (HF_HUB_OFFLINE=1: no internet here). The library reads HF_HOME and HF_HUB_OFFLINE when it is
imported, so each case runs in a process of its own."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.engine.llm_engine import LLMEngine
from tests.engine.test_engine_correctness import GREEDY

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "acme/tiny-llama"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, tiny_model) -> Path:
    """An HF_HOME whose hub cache holds `tiny_model` as revision main of acme/tiny-llama."""
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / "models--acme--tiny-llama"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in sorted(Path(tiny_model).iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return home


def offline(hf_home: Path, *args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)


def test_a_hub_name_generates_what_its_directory_does(hf_home, tiny_model):
    """`pdserve generate --model acme/tiny-llama` reads the snapshot and gives the tokens the
    directory gives in process."""
    prompt = [256, 10, 20, 30, 40]
    exe = Path(sys.executable).parent / "pdserve"
    out = offline(hf_home, str(exe), "generate", "--model", REPO, "--prompt-token-ids", ",".join(map(str, prompt)),
                  "--max-tokens", "6", "--ignore-eos", "--json")
    assert out.returncode == 0, out.stderr
    want = LLMEngine.from_model(tiny_model, num_blocks=16).generate([prompt], GREEDY)[0].token_ids[:6]
    assert json.loads(out.stdout)["token_ids"] == want


RESOLVE = """
import json, sys
from cluster.engine.model.hub import resolve_checkpoint
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = resolve_checkpoint(name)
    except ValueError as e:
        out[name] = "ValueError: " + str(e)
print(json.dumps(out))
"""


def test_names_resolve_to_the_snapshot_or_are_refused_naming_the_field(hf_home, tiny_model, tmp_path):
    out = offline(hf_home, sys.executable, "-c", RESOLVE, REPO, tiny_model, "acme/missing", "not/a/repo/id")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    snapshot = hf_home / "hub" / "models--acme--tiny-llama" / "snapshots" / COMMIT
    assert (got[REPO], got[tiny_model]) == (str(snapshot), tiny_model)  # a directory is itself
    assert got["acme/missing"].startswith("ValueError: model='acme/missing' is not a checkpoint directory, and the "
                                          "Hugging Face Hub could not resolve it as a repo id (")
    assert got["not/a/repo/id"].startswith("ValueError: model='not/a/repo/id' is neither a checkpoint directory nor "
                                           "a Hugging Face Hub repo id (org/name): ")


def test_pdserve_up_refuses_an_unresolvable_name_before_ray_starts(hf_home):
    exe = Path(sys.executable).parent / "pdserve"
    out = offline(hf_home, str(exe), "up", "--model", "acme/missing")
    assert out.returncode == 2
    assert out.stderr.startswith("pdserve up: model='acme/missing' is not a checkpoint directory, and the Hugging "
                                 "Face Hub could not resolve it as a repo id (")
