class KVTransferError(RuntimeError):
    """A transfer failed or stalled; the decode side's policy decides what happens next."""


class IncompatiblePeerError(KVTransferError):
    """The peer's KV cache cannot be read as ours (model, block size, dtype or layout differ)."""


class TransportUnavailableError(RuntimeError):
    """A transport the configuration requires is not available on this node."""
