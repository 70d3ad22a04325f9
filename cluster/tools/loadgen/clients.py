"""One asyncio client per API. Every request is a coroutine on the runner's single event loop
(grpc.aio streams on one channel, aiohttp for HTTP): no thread per request, so thousands of
streams cost the client little and its timestamps stay close to the wire.

A client fills a `RequestRecord` as messages arrive and returns the answer, which a multi-turn
session appends to its next prompt.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Protocol

from cluster.tools.loadgen.datasets import Prompt
from cluster.tools.loadgen.records import RequestRecord


@dataclass(frozen=True)
class ServerInfo:
    model: str
    max_model_len: int
    vocab_size: int | None  # None where the API does not say (OpenAI /v1/models)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = False


@dataclass(frozen=True)
class Answer:
    token_ids: tuple[int, ...] | None  # None where the API streams text only (OpenAI SSE)
    text: str


class Client(Protocol):
    name: str

    async def server_info(self) -> ServerInfo: ...

    async def generate(self, prompt: Prompt, rec: RequestRecord) -> Answer | None:
        """Send one request and stream it into `rec`; None when it failed (rec says why)."""
        ...

    async def close(self) -> None: ...


class GrpcClient:
    """`pdserve.v1.Generation/Generate` over one grpc.aio channel (HTTP/2 multiplexes the streams)."""

    name = "grpc"

    def __init__(self, address: str, api_key: str | None = None, model: str = "", sampling: Sampling = Sampling()):
        import grpc  # noqa: PLC0415

        from protos.pdserve.v1 import generation_pb2 as pb  # noqa: PLC0415
        from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc  # noqa: PLC0415

        self._grpc, self._pb = grpc, pb
        self.address = address
        self.model = model
        self.sampling = sampling
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._stub_class = pb_grpc.GenerationStub
        self.channel = None
        self._stub = None

    @property
    def stub(self):
        if self._stub is None:  # an aio channel belongs to the loop it is made in: make it in the run's
            self.channel = self._grpc.aio.insecure_channel(self.address)
            self._stub = self._stub_class(self.channel)
        return self._stub

    async def server_info(self, timeout_s: float = 30.0) -> ServerInfo:
        resp = await self.stub.ListModels(self._pb.ListModelsRequest(), metadata=self.metadata, timeout=timeout_s)
        models = {m.id: m for m in resp.models}
        m = models.get(self.model) if self.model else next(iter(models.values()), None)
        if m is None:
            raise RuntimeError(f"the server at {self.address} serves {sorted(models)}, not {self.model!r}")
        return ServerInfo(m.id, m.max_model_len, m.vocab_size)

    def _request(self, prompt: Prompt, max_tokens: int):
        pb = self._pb
        sp = pb.SamplingParams(max_tokens=max_tokens, temperature=self.sampling.temperature,
                               top_p=self.sampling.top_p, ignore_eos=self.sampling.ignore_eos)
        if prompt.token_ids is not None:
            return pb.GenerateRequest(model=self.model, token_ids=pb.TokenIds(ids=prompt.token_ids), sampling=sp)
        return pb.GenerateRequest(model=self.model, text=prompt.text, sampling=sp)

    async def generate(self, prompt: Prompt, rec: RequestRecord) -> Answer | None:
        req = self._request(prompt, rec.max_tokens)
        ids: list[int] = []
        text: list[str] = []
        last = None
        rec.sent()
        call = self.stub.Generate(req, metadata=self.metadata)
        try:
            async for resp in call:
                if resp.token_ids:
                    rec.on_tokens(len(resp.token_ids))
                    ids += resp.token_ids
                text.append(resp.text)
                last = resp
        except self._grpc.aio.AioRpcError as e:
            rec.fail(e.code().name, e.details() or "")
            return None
        except asyncio.CancelledError:
            call.cancel()
            raise
        pb = self._pb
        if last is None or last.finish_reason in (pb.FINISH_REASON_UNSPECIFIED, pb.FINISH_REASON_ERROR,
                                                  pb.FINISH_REASON_CANCELLED):
            reason = "no response" if last is None else pb.FinishReason.Name(last.finish_reason)
            rec.fail("BAD_FINISH", f"stream ended with {reason}")
            return None
        rec.finish(last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_prompt_tokens)
        return Answer(tuple(ids), "".join(text))

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


class OpenAIClient:
    """`/v1/completions` with SSE. Chunks carry text, not token ids, so each chunk counts as one
    token-carrying message and token totals come from the final usage chunk."""

    name = "openai"

    def __init__(self, base_url: str, api_key: str | None = None, model: str = "", sampling: Sampling = Sampling()):
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.sampling = sampling
        self.headers = {"content-type": "application/json"}
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"
        self._session = None

    def session(self):
        import aiohttp  # noqa: PLC0415

        if self._session is None:  # created inside the running loop
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=30))
        return self._session

    async def server_info(self) -> ServerInfo:
        async with self.session().get(f"{self.base_url}/v1/models", headers=self.headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"GET /v1/models: HTTP {resp.status}: {await resp.text()}")
            data = (await resp.json())["data"]
        models = {m["id"]: m for m in data}
        m = models.get(self.model) if self.model else (data[0] if data else None)
        if m is None:
            raise RuntimeError(f"the server at {self.base_url} serves {sorted(models)}, not {self.model!r}")
        return ServerInfo(m["id"], int(m.get("max_model_len") or 0), None)

    async def generate(self, prompt: Prompt, rec: RequestRecord) -> Answer | None:
        import aiohttp  # noqa: PLC0415

        body = {"model": self.model or None, "max_tokens": rec.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": self.sampling.temperature,
                "top_p": self.sampling.top_p, "ignore_eos": self.sampling.ignore_eos,
                "prompt": list(prompt.token_ids) if prompt.token_ids is not None else prompt.text}
        text: list[str] = []
        usage = None
        rec.sent()
        try:
            async with self.session().post(f"{self.base_url}/v1/completions", json=body,
                                           headers=self.headers) as resp:
                if resp.status != 200:
                    rec.fail(f"HTTP {resp.status}", (await resp.text())[:500])
                    return None
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        err = chunk["error"]
                        rec.fail(str(err.get("code") or "STREAM_ERROR"), str(err.get("message", "")))
                        return None
                    if chunk.get("choices"):
                        rec.on_tokens(1)
                        text.append(chunk["choices"][0].get("text") or "")
                    if chunk.get("usage"):
                        usage = chunk["usage"]
        except aiohttp.ClientError as e:
            rec.fail("CONNECTION_ERROR", f"{type(e).__name__}: {e}")
            return None
        if usage is None:
            rec.fail("BAD_FINISH", "stream ended without a usage chunk")
            return None
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        rec.finish(usage["prompt_tokens"], usage["completion_tokens"], cached)
        return Answer(None, "".join(text))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
