"""The response cache's key: every sampling field, enumerated from the dataclasses themselves
(SamplingParams, which the key is made of, and SamplingSpec, what a client sends), so a field
added later is checked too; a field the key left out would replay another request's answer."""

from dataclasses import fields, replace

from cluster.config import AppConfig, ResponseCacheOptions
from cluster.engine.sampling_params import SamplingParams
from cluster.errors import InvalidRequestError
from router.ingress.gateway.response_cache import ResponseCache

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def cache() -> ResponseCache:
    return ResponseCache(ResponseCacheOptions(), {"t"}, "v1")


def same_key(keys: dict, base: bytes) -> list[str]:
    """The fields whose change left the key equal to the base's or to another field's."""
    values = list(keys.values())
    return sorted(n for n, k in keys.items() if k is not None and (k == base or values.count(k) > 1))


def other_values(cls, base) -> dict[str, object]:
    """For every init field of dataclass `cls`, the first value (by the field's type) other than
    `base`'s that `cls` accepts: {field: instance with only that field changed}. A field whose type
    no candidate here fits is missing from the result (the caller's test then names it)."""
    from cluster.engine.grammar import ResponseFormat
    from router.ingress.request import ResponseFormatSpec

    by_type = {"bool": lambda v: [not v], "int": lambda v: [1 if v is None else v + 1],
               "float": lambda v: [0.5] if v is None else [v + 0.5, v - 0.5], "str": lambda v: ["x"],
               "ResponseFormat": lambda v: [ResponseFormat("json_object")],
               "ResponseFormatSpec": lambda v: [ResponseFormatSpec("json_object")],
               "tuple[str, ...]": lambda v: [("x",)], "tuple[int, ...]": lambda v: [(3,)],
               "tuple[tuple[int, float], ...]": lambda v: [((3, 1.0),)], "Mapping": lambda v: [{3: 1.0}]}
    out = {}
    for f in fields(cls):
        if not f.init:
            continue
        types = [t.strip() for t in f.type.split("|") if t.strip() != "None"]  # annotations are strings here
        values = [v for t in types if t in by_type for v in by_type[t](getattr(base, f.name))]
        for value in values:
            try:
                out[f.name] = replace(base, **{f.name: value})
                break
            except InvalidRequestError:
                continue
    return out


def test_every_sampling_param_is_in_the_key():
    """Each SamplingParams field, changed alone, changes the key (or makes the request not
    cacheable: temperature). The fields are enumerated: one added later is checked too."""
    c = cache()
    varied = other_values(SamplingParams, GREEDY)
    assert sorted(varied) == sorted(f.name for f in fields(SamplingParams) if f.init)
    base = c.key("t", [1, 2], GREEDY)
    assert base == c.key("t", [1, 2], SamplingParams(max_tokens=4, temperature=0.0))
    keys = {name: c.key("t", [1, 2], params) for name, params in varied.items()}
    assert [name for name, k in keys.items() if k is None] == ["temperature"]
    assert same_key(keys, base) == []
    assert base != c.key("t", [1, 3], GREEDY)
    assert base != ResponseCache(ResponseCacheOptions(), {"t"}, "v2").key("t", [1, 2], GREEDY)


def test_every_client_sampling_field_reaches_the_key(tiny_model):
    """Each SamplingSpec field the client sends, changed alone, changes the key of the request's
    SamplingParams (a field the flow dropped would share another request's cached answer)."""
    from router.ingress.request import SamplingSpec
    from tests.helpers import front_door

    flow = front_door(AppConfig.model_validate({"model": tiny_model})).catalog.flows[0]
    c = cache()
    spec = SamplingSpec(max_tokens=4, temperature=0.0)
    varied = other_values(SamplingSpec, spec)
    assert sorted(varied) == sorted(f.name for f in fields(SamplingSpec))
    base = c.key("t", [1, 2], flow.sampling(spec).params)
    keys = {name: c.key("t", [1, 2], flow.sampling(other).params) for name, other in varied.items()}
    assert [name for name, k in keys.items() if k is None] == ["temperature"]
    assert same_key(keys, base) == []
