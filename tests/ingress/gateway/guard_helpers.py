"""What the guardrail tests share: a delta, a guard over one rule, a source that records
whether the guard closed it early, and the classifier deployment in this process."""

import asyncio

from cluster.config import AppConfig
from router.ingress.gateway.guardrails import Guardrails
from router.ingress.request import Delta


def D(text, finish=None, n=0):  # noqa: N802
    return Delta("r", text, [n], finish, prompt_tokens=3, completion_tokens=n)


def guard_for(words=("kill",), window=8, on_error="closed", pattern=None, applies_to="both"):
    rule = {"name": "r1", "applies_to": applies_to, **({"pattern": pattern} if pattern else {"words": list(words)})}
    cfg = AppConfig(guardrail_policies={"p": {"rules": [rule], "holdback_chars": window, "on_error": on_error}},
                    guardrail_policy="p")
    return Guardrails(cfg).for_request("default")


class Source:
    """The flow's side: an async generator of deltas that records whether it was closed early."""

    def __init__(self, pieces, finish="length"):
        self.pieces = pieces
        self.finish = finish
        self.pulled = 0
        self.closed_early = False

    async def gen(self):
        try:
            for i, text in enumerate(self.pieces):
                self.pulled = i + 1
                yield D(text, self.finish if i == len(self.pieces) - 1 else None, n=i + 1)
        except GeneratorExit:
            self.closed_early = True
            raise


def run(guard, source):
    async def collect():
        return [d async for d in guard.output(source.gen())]
    return asyncio.run(collect())


class LocalClassifier:
    """The classifier deployment's class in this process, called as its Serve handle is."""

    def __init__(self, **options):
        from cluster.serving.classifier import KeywordClassifierStandIn
        from types import SimpleNamespace

        self.impl = KeywordClassifierStandIn({"guardrail_classifier": options})
        self.calls: list[int] = []

        async def classify(text):
            self.calls.append(len(text))
            return await self.impl.classify(text)
        self.classify = SimpleNamespace(remote=classify)
