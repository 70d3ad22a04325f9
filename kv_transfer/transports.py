"""Which UCX transports this node can use, checked at start-up against what the config requires.

NIXL exposes no query for UCX's selection, so availability is derived from the UCX transport
modules NIXL ships and the devices present (InfiniBand HCAs, CUDA), narrowed by UCX_TLS. UCX
itself prints the protocol it selects per endpoint when UCX_PROTO_INFO=y (config: ucx_proto_info).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from kv_transfer.errors import TransportUnavailableError

# transport name -> (UCX module that implements it, device check)
_TRANSPORTS = {
    "tcp": (None, "always"),
    "sysv": (None, "always"),
    "posix": (None, "always"),
    "cma": ("libuct_cma", "always"),
    "rc": ("libuct_ib", "ib"),
    "ud": ("libuct_ib", "ib"),
    "dc": ("libuct_ib_mlx5", "ib"),
    "cuda_copy": ("libuct_cuda", "cuda"),
    "cuda_ipc": ("libuct_cuda", "cuda"),
    "gdr_copy": ("libuct_cuda_gdrcopy", "gdr"),
}
_ALIASES = {"shm": {"sysv", "posix"}, "ib": {"rc", "ud", "dc"}, "cuda": {"cuda_copy", "cuda_ipc"}}


def _ucx_module_dir() -> Path | None:
    for name in ("nixl_cu13", "nixl_cu12", "nixl"):
        spec = importlib.util.find_spec(name)
        if spec and spec.origin:
            d = Path(spec.origin).parent.parent / f"{name}.libs" / "ucx"
            if d.is_dir():
                return d
    return None


def _device_present(kind: str) -> bool:
    if kind == "always":
        return True
    if kind == "ib":
        ib = Path("/sys/class/infiniband")
        return ib.is_dir() and any(ib.iterdir())
    if kind == "cuda":
        import torch  # noqa: PLC0415

        return torch.cuda.is_available()
    if kind == "gdr":
        return Path("/dev/gdrdrv").exists()
    return False


def available_transports() -> list[str]:
    mod_dir = _ucx_module_dir()
    modules = {p.name.split(".so")[0] for p in mod_dir.glob("libuct_*.so*")} if mod_dir else set()
    found = [
        tl for tl, (module, device) in _TRANSPORTS.items()
        if (module is None or module in modules) and _device_present(device)
    ]
    allowed = os.environ.get("UCX_TLS", "").strip()
    if allowed and not allowed.startswith("^") and allowed != "all":
        names = set()
        for tl in allowed.split(","):
            names |= _ALIASES.get(tl, {tl})
        found = [tl for tl in found if tl in names]
    return found


def check_required(required: list[str]) -> list[str]:
    """Returns the available transports, or raises naming the missing ones."""
    available = available_transports()
    missing = []
    for tl in required:
        if not (_ALIASES.get(tl, {tl}) & set(available)):
            missing.append(tl)
    if missing:
        raise TransportUnavailableError(
            f"required UCX transports {missing} are not available on this node "
            f"(available: {available}; UCX_TLS={os.environ.get('UCX_TLS', '<unset>')!r}). "
            "Refusing to start rather than fall back to a slower transport."
        )
    return available


def enable_cuda_ipc_reads() -> None:
    """Let UCX READ GPU memory over cuda_ipc on GPUs without NVLink.

    A pull is a READ (ucp_get). UCX turns cuda_ipc's get_zcopy off when it finds no NVLink ("cuda-ipc
    get zcopy disabled as no nvlinks detected"), and the READ then falls to software emulation over
    TCP: 0.5 GB/s between two processes on one H200 (docs/benchmarks.md, "The GPU path"). With it
    on, the same READ is a device copy through a CUDA IPC handle. Set before the UCX context is made
    (an agent's creation); a value the operator set wins."""
    os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")

