"""gRPC front end of the GPU service: `moesplit.v1.GenerateService` over the engine (thin servicer).

`Generate` streams one `GenerateResponse` per engine step that produced something for the
request; the last carries `finish_reason` and `usage`. A client that cancels (or whose deadline
passes) cancels the engine request, freeing its KV pages at the next step boundary. Bad requests
fail with INVALID_ARGUMENT, a stopping server with UNAVAILABLE. The standard `grpc.health.v1`
service is registered (service names "" and "moesplit.v1.GenerateService").
"""
from __future__ import annotations

import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gpu_service.runtime.engine import Engine, EngineStopped, RequestError
from gpu_service.runtime.sampling import SamplingParams
from gpu_service.api.tokenizer import TokenizerError
from protos.moesplit.v1 import generate_pb2, generate_pb2_grpc

log = logging.getLogger("moesplit.grpc")
SERVICE_NAME = "moesplit.v1.GenerateService"


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, engine: Engine, tokenizer=None):
        self.engine = engine
        self.tokenizer = tokenizer

    def _prompt_ids(self, req: generate_pb2.GenerateRequest, context) -> list[int]:
        forms = [bool(req.prompt), bool(req.prompt_ids), bool(req.messages)]
        if sum(forms) != 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "give exactly one of prompt, prompt_ids or messages")
        if req.prompt_ids:
            return list(req.prompt_ids)
        if self.tokenizer is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "this model has no tokenizer.json: send prompt_ids instead of text")
        try:
            if req.prompt:
                return self.tokenizer.encode(req.prompt)
            return self.tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in req.messages])
        except TokenizerError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"chat template: {e}")

    def Generate(self, request, context):
        ids = self._prompt_ids(request, context)
        try:
            params = SamplingParams(request.temperature, request.top_p if request.HasField("top_p") else 1.0,
                                    request.top_k, request.seed if request.HasField("seed") else None)
            h = self.engine.submit(ids, params, request.max_tokens if request.HasField("max_tokens") else None,
                                   stop=list(request.stop), ignore_eos=request.ignore_eos,
                                   cache_salt=request.cache_salt or None)
        except (RequestError, ValueError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineStopped as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        context.add_callback(h.cancel)  # runs when the RPC ends; a no-op once the request finished
        for out in h:
            if out.finish_reason == "cancelled":
                if context.is_active():
                    context.abort(grpc.StatusCode.UNAVAILABLE, "the request was cancelled (server stopping)")
                return
            if out.finish_reason == "error":
                code = grpc.StatusCode.UNAVAILABLE if out.unavailable else grpc.StatusCode.INTERNAL
                context.abort(code, out.error or "generation failed")
            resp = generate_pb2.GenerateResponse(token_ids=out.token_ids, text=out.text,
                                                 finish_reason=out.finish_reason or "")
            if out.finish_reason is not None:
                resp.usage.CopyFrom(generate_pb2.Usage(
                    prompt_tokens=h.prompt_tokens, completion_tokens=h.completion_tokens,
                    total_tokens=h.prompt_tokens + h.completion_tokens, cached_tokens=h.cached_tokens))
            yield resp


def create_server(engine: Engine, tokenizer=None, host: str = "127.0.0.1", port: int = 50050,
                  max_workers: int = 64) -> tuple[grpc.Server, int]:
    """Build and start the gRPC server; returns (server, bound port) so tests can pass port 0."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="moesplit-grpc"))
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(engine, tokenizer), server)
    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the gRPC API to {host}:{port}; pick another --grpc-port")
    for name in ("", SERVICE_NAME):
        hs.set(name, health_pb2.HealthCheckResponse.SERVING)
    server.health_servicer = hs  # so shutdown can flip to NOT_SERVING first
    server.start()
    return server, bound
