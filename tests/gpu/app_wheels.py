"""Build the wheel set that `tests/gpu/app_check.sh` installs on a lent GPU machine (no network, no
Ray there): what its image lacks to run `pdserve up` under Ray Serve, small enough to travel in one
call (64 MiB with the repository).

    python tests/gpu/app_wheels.py DOWNLOADS OUT      # DOWNLOADS: `pip download --no-deps` of WANTED

Ray and nixl-cu13 are repacked: the parts pdserve never loads are dropped (DROP, found by rehearsing
the whole app on the CPU with nothing else installed), ELF files are stripped of their symbols, and
every wheel is recompressed with LZMA (zip method 14, which pip's unpacker reads). The other wheels
are copied unchanged. RECORD is rewritten for the files kept.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# pinned to this repository's .venv; the image (KINDS.md) has the rest (aiohttp, grpcio, numpy, torch ...)
WANTED = [
    "ray==2.60.0", "nixl==1.5.1", "nixl-cu13==1.5.1",
    "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
    "typing-extensions==4.16.0",
    "fastapi==0.165.0", "starlette==1.10.0", "uvicorn==0.54.0", "opentelemetry-api==1.45.2",  # fastapi imports it
    "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0", "rpds-py==2026.9.1",
    "grpcio-health-checking==1.85.1", "grpcio-reflection==1.85.1", "llguidance==1.9.1",
    # protos/ was generated for grpcio >= 1.85.1 and protobuf >= 7.35.1; the image's versions were never read
    "grpcio==1.85.3", "protobuf==7.36.2",
]

# fnmatch patterns of wheel members left out (matched against the member's path)
DROP = {
    "ray": [
        "ray/jars/*", "ray/rllib/*", "ray/tune/*", "ray/train/*", "ray/data/*", "ray/llm/*", "ray/air/*",
        "ray/workflow/*", "ray/dashboard/client/*", "ray/util/spark/*", "ray/util/dask/*",
        "ray/util/joblib/*", "ray/util/multiprocessing/*", "ray/util/collective/*", "ray/autoscaler/gcp/*",
        "ray/autoscaler/aws/*", "ray/autoscaler/azure/*", "ray/autoscaler/kuberay/*", "ray/autoscaler/_private/gcp/*",
        "ray/autoscaler/_private/aws/*", "ray/autoscaler/_private/_azure/*", "ray/autoscaler/_private/kuberay/*",
        "ray/autoscaler/_private/vsphere/*", "ray/autoscaler/_private/spark/*",
        "*/tests/*", "*.pyi",
    ],
    "nixl_cu13": [
        "nixl_ep_cu13/*",                              # expert-parallel kernels (three torch builds, 95 MB)
        "nixl_cu13.libs/nixl/*",                       # a second copy of the plugins (libnixl loads $ORIGIN/plugins)
        "nixl_cu13-1.5.1.data/*", "nixl_cu13.scripts/*",  # headers, examples
        ".nixl_cu13.mesonpy.libs/plugins/libplugin_[!U]*",  # every backend but UCX (object stores, GDS, ...)
        ".nixl_cu13.mesonpy.libs/plugins/libtelemetry_*", ".nixl_cu13.mesonpy.libs/plugins/libtrace_*",
        ".nixl_cu13.mesonpy.libs/libobj_utils.so", ".nixl_cu13.mesonpy.libs/libnixl_test_utils.so",
        "nixl_cu13.libs/libaws-*", "nixl_cu13.libs/libazure-*", "nixl_cu13.libs/libs2n-*",
        "nixl_cu13.libs/libcurl-*", "nixl_cu13.libs/libxml2-*", "nixl_cu13.libs/libgusli_*",
        "nixl_cu13.libs/ucx/libucx_perftest_*", "nixl_cu13.libs/ucx/libuct_ib*",  # no InfiniBand on the VM
        "nixl_cu13.libs/ucx/*.la", "nixl_cu13.libs/libibverbs-*", "nixl_cu13.libs/libmlx5-*",
        "nixl_cu13.libs/libnl-*",
    ],
}


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _strip(data: bytes) -> bytes:
    if data[:4] != b"\x7fELF":
        return data
    with tempfile.NamedTemporaryFile(delete=False) as f:
        f.write(data)
    try:
        subprocess.run(["strip", "--strip-unneeded", f.name], check=True, capture_output=True)
        return Path(f.name).read_bytes()
    finally:
        Path(f.name).unlink()


def repack(src: Path, out: Path, drop: list[str]) -> tuple[int, int]:
    """Rewrite one wheel into out/ (same name); returns (members kept, members dropped)."""
    kept = dropped = 0
    record_name = None
    lines = []
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out / src.name, "w", zipfile.ZIP_LZMA) as zout:
        for info in zin.infolist():
            name = info.filename
            if name.endswith(".dist-info/RECORD"):
                record_name = name
                continue
            if any(fnmatch.fnmatch(name, p) for p in drop):
                dropped += 1
                continue
            data = zin.read(info)
            if drop:
                data = _strip(data)
            zi = zipfile.ZipInfo(name, date_time=info.date_time)
            zi.external_attr = info.external_attr  # keeps executables (raylet, gcs_server) executable
            zi.compress_type = zipfile.ZIP_LZMA
            zout.writestr(zi, data)
            lines.append(_record_line(name, data))
            kept += 1
        lines.append(f"{record_name},,")
        zout.writestr(record_name, "\n".join(lines) + "\n")
    return kept, dropped


def main() -> None:
    src_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    for whl in sorted(src_dir.glob("*.whl")):
        project = whl.name.split("-")[0]
        drop = DROP.get(project, [])
        kept, dropped = repack(whl, out, drop)
        size = (out / whl.name).stat().st_size
        print(f"{whl.name}: {whl.stat().st_size / 2**20:.2f} -> {size / 2**20:.2f} MiB"
              + (f" ({dropped} members dropped, {kept} kept)" if drop else ""))
    total = sum(p.stat().st_size for p in out.glob("*.whl"))
    print(f"total {total / 2**20:.2f} MiB in {out}")


if __name__ == "__main__":
    shutil.which("strip") or sys.exit("strip (binutils) is needed")
    main()
