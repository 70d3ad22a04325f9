"""flow/legs.py `via`: a call goes over Serve's gRPC channel to the replica, but a request whose
prompt or outputs may come near that channel's 4 MiB message cap goes by reference (Ray objects)."""

import pytest

from cluster.engine.sampling_params import SamplingParams
from router.ingress.flow.legs import VIA_GRPC_MAX_TOKENS, via


class Handle:
    """A deployment handle's options, as Serve's records them."""

    def __init__(self, **options):
        self.options_given = options

    def options(self, **options):
        return Handle(**{**self.options_given, **options})


@pytest.mark.parametrize("n, sampling, by_grpc", [
    (64, SamplingParams(max_tokens=4), True),
    (VIA_GRPC_MAX_TOKENS, SamplingParams(max_tokens=4), True),
    (VIA_GRPC_MAX_TOKENS + 1, SamplingParams(max_tokens=4), False),
    (64, SamplingParams(max_tokens=4, logprobs=0), False),
    (64, SamplingParams(max_tokens=4, prompt_logprobs=0), False),
])
def test_a_call_goes_by_grpc_unless_its_messages_may_be_large(n, sampling, by_grpc):
    handle = Handle()
    chosen = via(handle, [1] * n, sampling)
    assert chosen.options_given == ({"_by_reference": False} if by_grpc else {})
