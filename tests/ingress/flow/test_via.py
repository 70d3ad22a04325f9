"""flow/legs.py `Homes.via`: a call goes over Serve's gRPC channel to the replica, but a request whose
prompt or outputs may come near that channel's 4 MiB message cap goes by reference (Ray objects).
Each variant of a home's handle is made once."""

import pytest

from cluster.engine.sampling_params import SamplingParams
from router.ingress.flow.legs import VIA_GRPC_MAX_TOKENS, Homes


class Handle:
    """A deployment handle's options, as Serve's records them."""

    made = 0

    def __init__(self, home: str = "decode", **options):
        self.home = home
        self.options_given = options

    def options(self, **options):
        Handle.made += 1
        return Handle(self.home, **{**self.options_given, **options})

    def __getattr__(self, name: str):  # a method: Serve's handles give options(method_name=name)
        return self.options(method_name=name)


@pytest.mark.parametrize("n, sampling, by_grpc", [
    (64, SamplingParams(max_tokens=4), True),
    (VIA_GRPC_MAX_TOKENS, SamplingParams(max_tokens=4), True),
    (VIA_GRPC_MAX_TOKENS + 1, SamplingParams(max_tokens=4), False),
    (64, SamplingParams(max_tokens=4, logprobs=0), False),
    (64, SamplingParams(max_tokens=4, prompt_logprobs=0), False),
])
def test_a_call_goes_by_grpc_unless_its_messages_may_be_large(n, sampling, by_grpc):
    homes = Homes({"decode": Handle()}, None)
    grpc = {"_by_reference": False, "request_serialization": "pickle"} if by_grpc else {}
    chosen = homes.via("decode", "prefill", [1] * n, sampling)
    assert chosen.options_given == {"method_name": "prefill", **grpc}
    streamed = homes.via("decode", "generate", [1] * n, sampling, stream=True)
    assert streamed.options_given == {"method_name": "generate", **grpc, "stream": True}


def test_each_homes_variant_is_made_once_and_an_unknown_home_is_the_default():
    decode, prefill = Handle("decode"), Handle("prefill")
    homes = Homes({"decode": decode, "prefill": prefill}, decode)
    short = [1] * 8
    Handle.made = 0
    first = homes.via("prefill", "generate", short, SamplingParams(max_tokens=4), stream=True)
    assert (first.home, first.options_given) == ("prefill", {"method_name": "generate", "_by_reference": False,
                                                             "request_serialization": "pickle", "stream": True})
    assert homes.via("prefill", "generate", short, SamplingParams(max_tokens=9), stream=True) is first
    assert Handle.made == 3  # _by_reference, stream, method: once
    assert homes.via("prefill", "prefill", short, SamplingParams(max_tokens=4)) is not first
    assert homes.via(None, "prefill", short, SamplingParams(max_tokens=4)).home == "decode"
    assert homes.via("flipped-away", "prefill", short, SamplingParams()) is homes.via(None, "prefill", short,
                                                                                      SamplingParams())
    assert homes.get("prefill") is prefill and homes.get(None) is decode


def test_a_ray_without_request_serialization_still_goes_by_grpc():
    class OldHandle(Handle):
        def options(self, request_serialization=None, **options):
            if request_serialization is not None:
                raise TypeError("options() got an unexpected keyword argument 'request_serialization'")
            return OldHandle(self.home, **{**self.options_given, **options})

    homes = Homes({"decode": OldHandle()}, None)
    chosen = homes.via("decode", "generate", [1] * 8, SamplingParams(max_tokens=4), stream=True)
    assert chosen.options_given == {"_by_reference": False, "stream": True, "method_name": "generate"}
