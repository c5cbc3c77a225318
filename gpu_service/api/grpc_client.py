"""Python client of `moesplit.v1.GenerateService` (used by `moesplit chat` and the tests).

    with GenerateClient("127.0.0.1:50050") as c:
        for r in c.generate(prompt="Hello", max_tokens=32):   # GenerateResponse per step
            print(r.text, end="", flush=True)
        r = next(c.generate(prompt_ids=[0, 5, 9], max_tokens=8, stream=False))  # one merged response
"""
from __future__ import annotations

from typing import Iterator

import grpc

from protos.moesplit.v1 import generate_pb2, generate_pb2_grpc


class GenerateClient:
    """`api_key`: sent as `authorization: Bearer` metadata (the server's --api-key); `root_ca`:
    PEM bytes of the CA of a TLS Generate port (with `cert`/`key` PEM bytes for a client certificate)."""

    def __init__(self, address: str, timeout_s: float | None = None, api_key: str | None = None,
                 root_ca: bytes | None = None, cert: bytes | None = None, key: bytes | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        if root_ca is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=root_ca, private_key=key, certificate_chain=cert)
            self.channel = grpc.secure_channel(address, creds)
        else:
            self.channel = grpc.insecure_channel(address)
        self.stub = generate_pb2_grpc.GenerateServiceStub(self.channel)

    def generate(self, prompt: str | None = None, prompt_ids: list[int] | None = None,
                 messages: list[dict] | None = None, max_tokens: int | None = None, temperature: float = 0.0,
                 top_p: float | None = None, top_k: int = 0, seed: int | None = None,
                 stop: list[str] | None = None, ignore_eos: bool = False,
                 stream: bool = True) -> Iterator[generate_pb2.GenerateResponse]:
        """Iterator of GenerateResponse (token_ids, text, finish_reason, usage); with stream=False a
        single response holding everything. Closing the iterator early cancels the request."""
        req = generate_pb2.GenerateRequest(
            prompt=prompt or "", prompt_ids=prompt_ids or [],
            messages=[generate_pb2.ChatMessage(role=m["role"], content=m.get("content") or "",
                                               reasoning_content=m.get("reasoning_content") or "")
                      for m in messages or []],
            temperature=temperature, top_k=top_k, stop=stop or [], ignore_eos=ignore_eos)
        if max_tokens is not None:
            req.max_tokens = max_tokens
        if top_p is not None:
            req.top_p = top_p
        if seed is not None:
            req.seed = seed
        call = self.stub.Generate(req, timeout=self.timeout_s, wait_for_ready=True, metadata=self.metadata)
        return _stream(call) if stream else _merged(call)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "GenerateClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stream(call) -> Iterator[generate_pb2.GenerateResponse]:
    try:
        yield from call
    finally:
        call.cancel()  # no-op when finished; cancels the server request when the caller stopped early


def _merged(call) -> Iterator[generate_pb2.GenerateResponse]:
    out = generate_pb2.GenerateResponse()
    text, reasoning = [], []
    for r in call:
        out.token_ids.extend(r.token_ids)
        text.append(r.text)
        reasoning.append(r.reasoning)
        out.tool_calls.extend(r.tool_calls)  # pieces, by index (see generate.proto's ToolCall)
        if r.finish_reason:
            out.finish_reason = r.finish_reason
            out.usage.CopyFrom(r.usage)
    out.text, out.reasoning = "".join(text), "".join(reasoning)
    yield out
