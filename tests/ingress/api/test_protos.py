"""The committed gRPC code is what `make protos` generates from protos/ (CI fails when stale)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
GENERATED = ["generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py"]


def test_generated_code_is_fresh(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT), f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", "protos/pdserve/v1/generation.proto"],
        check=True, cwd=ROOT,
    )
    for name in GENERATED:
        fresh = (tmp_path / "protos/pdserve/v1" / name).read_text()
        committed = (ROOT / "protos/pdserve/v1" / name).read_text()
        assert fresh == committed, f"protos/pdserve/v1/{name} is stale: run `make protos`"
