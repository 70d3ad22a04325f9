"""The committed gRPC code is what `make protos` generates from protos/ (CI fails when stale).

The generator stamps its own version into the code (the protobuf gencode version, the grpcio version
the stubs ask for). Those lines are not compared: the stubs are stale when the messages or services
differ, not when a newer grpcio-tools release would stamp another number (the lock pins one, and a
user's grpcio-tools may be any release in pyproject.toml's range)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
GENERATED = ["generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py"]
# Each a line the generator writes with its own version in it (see the module docstring).
VERSION_STAMPS = [
    re.compile(r"^# Protobuf Python Version: .*$", re.M),
    re.compile(r"^(\s*_runtime_version\.ValidateProtobufRuntimeVersion\(\s*)[^)]*\)", re.M | re.S),
    re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.M),
]


def without_version_stamps(code: str) -> str:
    for stamp in VERSION_STAMPS:
        code = stamp.sub(lambda m: (m.group(1) if m.groups() else "") + "<version>", code)
    return code


def test_version_stamps_are_the_only_lines_ignored():
    committed = (ROOT / "protos/pdserve/v1/generation_pb2_grpc.py").read_text()
    bumped = re.sub(r"GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = '9.99.9'", committed)
    assert bumped != committed and without_version_stamps(bumped) == without_version_stamps(committed)
    renamed = committed.replace("GenerationStub", "GenerationStubX", 1)
    assert without_version_stamps(renamed) != without_version_stamps(committed)
    pb2 = (ROOT / "protos/pdserve/v1/generation_pb2.py").read_text()
    assert without_version_stamps(pb2).count("<version>") == 2  # the comment and the runtime check


def test_generated_code_is_fresh(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT), f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", "protos/pdserve/v1/generation.proto"],
        check=True, cwd=ROOT,
    )
    for name in GENERATED:
        fresh = without_version_stamps((tmp_path / "protos/pdserve/v1" / name).read_text())
        committed = without_version_stamps((ROOT / "protos/pdserve/v1" / name).read_text())
        assert fresh == committed, f"protos/pdserve/v1/{name} is stale: run `make protos`"
