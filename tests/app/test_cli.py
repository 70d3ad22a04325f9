"""The installed `pdserve` command: init-model and in-process generate."""

import json
import subprocess
import sys
from pathlib import Path

from tests.reference import hf_greedy


def pdserve(*args, check=True):
    exe = Path(sys.executable).parent / "pdserve"  # the venv's console script
    assert exe.is_file(), "pdserve console script is not installed"
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120, check=check)


def test_init_model_then_generate_json_equals_transformers(tmp_path):
    d = tmp_path / "demo"
    pdserve("init-model", str(d), "--layers", "2", "--hidden", "64")
    out = pdserve("generate", "--model", str(d), "--prompt-token-ids", "256,10,20,30,40",
                  "--max-tokens", "6", "--ignore-eos", "--json")
    result = json.loads(out.stdout)
    assert result["token_ids"] == hf_greedy(str(d), [256, 10, 20, 30, 40], 6)
    assert result["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "cached_tokens": 0}


def test_generate_bad_input_exits_2_with_the_field(tiny_model):
    out = pdserve("generate", "--model", tiny_model, "--prompt", "x", "--max-tokens", "-1", check=False)
    assert out.returncode == 2
    assert "max_tokens: must be >= 1, got -1" in out.stderr
