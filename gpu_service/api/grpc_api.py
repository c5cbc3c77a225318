"""gRPC Generate API over the engine (moesplit.v1.GenerateService) and the standard grpc.health.v1.

`Generate` streams one `GenerateResponse` per engine step that produced something; the last carries
`finish_reason` and `usage`. A cancelled RPC (or a passed deadline) cancels the engine request.
Fields mean what they mean in the HTTP API; bad requests are INVALID_ARGUMENT, a full queue
RESOURCE_EXHAUSTED, a stopping server UNAVAILABLE. With an API key every RPC but health needs
`authorization: Bearer <key>` (gpu_service.api.guard); `tls=` serves TLS, optionally requiring
client certificates.
"""
from __future__ import annotations

import base64
import json
import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gpu_service.api.chat_request import ChatPlan, ChatSettings, chat_plan
from gpu_service.api.errors import APIError, check_prompt_chars
from gpu_service.api.guard import KeyCheck, UNAUTHORIZED
from gpu_service.api.parsers.stream import merge_deltas
from gpu_service.runtime.engine import Engine, EngineStopped, QueueFull, RequestError
from gpu_service.runtime.requests import check_token_lists
from gpu_service.runtime.logits import grammar_reason
from gpu_service.runtime.grammar import GrammarError, GrammarSpec, InvalidSchema
from gpu_service.runtime.sampling import SamplingParams
from gpu_service.api.tokenizer import TokenizerError
from protos.moesplit.v1 import generate_pb2, generate_pb2_grpc

log = logging.getLogger("moesplit.grpc")
SERVICE_NAME = "moesplit.v1.GenerateService"


class AuthInterceptor(grpc.ServerInterceptor):
    """UNAUTHENTICATED for any RPC without `authorization: Bearer <key>` (health checks exempt, so
    probes need no key, as HTTP's /health)."""

    def __init__(self, api_key: str):
        self.keys = KeyCheck(api_key)

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHORIZED)

        self._deny = grpc.unary_stream_rpc_method_handler(deny)
        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return continuation(details)
        auth = next((v for k, v in details.invocation_metadata if k == "authorization"), None)
        if self.keys.ok(auth):
            return continuation(details)
        handler = continuation(details)  # answer in the method's own shape
        return self._deny if handler is None or handler.response_streaming else self._deny_unary


def _content(m, i: int, context):
    """A ChatMessage's content: `content`, or its `parts` as the HTTP API's content parts (an image
    as a data: URL of its bytes, so both APIs check it the same way)."""
    if not m.parts:
        return m.content
    if m.content:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"messages[{i}]: give content or parts, not both")
    out = []
    for j, p in enumerate(m.parts):
        if p.WhichOneof("part") == "text":
            out.append({"type": "text", "text": p.text})
        elif p.WhichOneof("part") == "image":
            if not p.image.mime_type.startswith("image/"):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"messages[{i}].parts[{j}].image.mime_type must be "
                                                                f"image/..., got {p.image.mime_type!r}")
            url = f"data:{p.image.mime_type};base64," + base64.b64encode(p.image.data).decode()
            out.append({"type": "image_url", "image_url": {"url": url}})
        else:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"messages[{i}].parts[{j}] is empty: set text or image")
    return out


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, engine: Engine, tokenizer=None, max_prompt_chars: int | None = None,
                 chat_settings: ChatSettings | None = None, image_policy=None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_prompt_chars = max_prompt_chars
        self.chat_settings = chat_settings or ChatSettings()
        self.image_policy = image_policy  # gpu_service.api.image_parts.ImagePolicy when images are served

    def _chat(self, req: generate_pb2.GenerateRequest, context) -> ChatPlan:
        """`messages` (+ tools, tool_choice, ...) through the HTTP API's chat plan: the model's own
        format, its reasoning and tool-call parsers, the forced-call grammar."""
        msgs = []
        for i, m in enumerate(req.messages):
            d = {"role": m.role, "content": _content(m, i, context)}
            if m.reasoning_content:
                d["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                   for c in m.tool_calls]
            if m.tool_call_id:
                d["tool_call_id"] = m.tool_call_id
            if m.name:
                d["name"] = m.name
            msgs.append(d)
        body: dict = {"messages": msgs}
        for field, key in (("tools_json", "tools"), ("tool_choice_json", "tool_choice"),
                           ("chat_template_kwargs_json", "chat_template_kwargs")):
            raw = getattr(req, field)
            if not raw:
                continue
            if key == "tool_choice" and raw in ("auto", "none", "required"):
                body[key] = raw
                continue
            try:
                body[key] = json.loads(raw)
            except json.JSONDecodeError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{field} is not valid JSON: {e}")
        if req.HasField("parallel_tool_calls"):
            body["parallel_tool_calls"] = req.parallel_tool_calls
        try:
            return chat_plan(body, self.tokenizer, self.chat_settings, self.max_prompt_chars, self.image_policy)
        except APIError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{e.param}: {e.message}" if e.param else e.message)

    def _prompt(self, req: generate_pb2.GenerateRequest, context) -> tuple[list[int], ChatPlan | None]:
        """The request's prompt ids, and for `messages` its chat plan (None for the other forms)."""
        forms = [bool(req.prompt), bool(req.prompt_ids), bool(req.messages)]
        if sum(forms) != 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "give exactly one of prompt, prompt_ids or messages")
        chat_only = [f for f in ("tools_json", "tool_choice_json", "chat_template_kwargs_json") if getattr(req, f)]
        if req.HasField("parallel_tool_calls"):
            chat_only.append("parallel_tool_calls")
        if chat_only and not req.messages:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{', '.join(chat_only)}: only with messages")
        if req.prompt_ids:
            return list(req.prompt_ids), None
        if self.tokenizer is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "this model has no tokenizer: send prompt_ids instead of text or messages")
        if req.messages:  # the chat plan refuses a conversation over --max-prompt-chars before rendering it
            plan = self._chat(req, context)
            return plan.ids, plan
        try:
            check_prompt_chars(len(req.prompt), self.max_prompt_chars, "prompt")
            return self.tokenizer.encode(req.prompt), None
        except (APIError, TokenizerError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.message if isinstance(e, APIError) else str(e))

    def _grammar(self, request):
        """The request's compiled grammar or None (GrammarError when it has none that compiles)."""
        kind = request.WhichOneof("constraint")
        if kind is None:
            return None
        if self.engine.grammars is None:
            raise GrammarError("structured outputs need the checkpoint's tokenizer.json")
        if kind == "json_schema":
            try:
                spec = GrammarSpec.json_schema(json.loads(request.json_schema))
            except (json.JSONDecodeError, RecursionError) as e:
                raise GrammarError(f"json_schema is not valid JSON: {e}") from None
        elif kind == "choice":
            spec = GrammarSpec.choice(list(request.choice.options))
        else:
            spec = {"json_object": GrammarSpec.json_object, "regex": GrammarSpec.regex,
                    "grammar": GrammarSpec.grammar}[kind](*(() if kind == "json_object" else (getattr(request, kind),)))
        try:
            return self.engine.grammars.compile(spec).result()
        except InvalidSchema:
            raise
        except GrammarError as e:
            raise GrammarError(f"{kind}: the grammar engine cannot compile this: {grammar_reason(str(e))}") from None

    def Generate(self, request, context):
        ids, plan = self._prompt(request, context)
        try:
            grammar = self._grammar(request)
            if plan is not None and plan.grammar is not None and self.engine.grammars is not None:
                if grammar is not None:
                    raise GrammarError("tool_choice 'required' or a named function cannot be combined with a "
                                       "structured-output constraint: drop one")
                grammar = self.engine.grammars.compile(plan.grammar).result()
            check_token_lists(request.stop_token_ids, list(request.logit_bias.items()))
            params = SamplingParams(
                request.temperature, request.top_p if request.HasField("top_p") else 1.0, request.top_k,
                request.seed if request.HasField("seed") else None, presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty,
                repetition_penalty=request.repetition_penalty if request.HasField("repetition_penalty") else 1.0,
                logit_bias=tuple(sorted(request.logit_bias.items())), min_tokens=request.min_tokens,
                stop_token_ids=tuple(request.stop_token_ids),
                logprobs=request.logprobs if request.HasField("logprobs") else None)
            h = self.engine.submit(ids, params, request.max_tokens if request.HasField("max_tokens") else None,
                                   stop=list(request.stop), ignore_eos=request.ignore_eos,
                                   grammar=grammar, cache_salt=request.cache_salt or None,
                                   images=plan.images if plan is not None else None)
        except QueueFull as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except (RequestError, ValueError) as e:  # GrammarError is a ValueError
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineStopped as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        context.add_callback(h.cancel)  # runs when the RPC ends; a no-op once the request finished
        parsed = plan.stream() if plan is not None else None
        for out in h:
            if out.finish_reason == "cancelled":
                if context.is_active():
                    context.abort(grpc.StatusCode.UNAVAILABLE, "the request was cancelled (server stopping)")
                return
            if out.finish_reason == "error":  # the request's own doing (param) or the server's
                code = (grpc.StatusCode.UNAVAILABLE if out.unavailable else grpc.StatusCode.INVALID_ARGUMENT
                        if out.param is not None else grpc.StatusCode.INTERNAL)
                context.abort(code, f"{out.param}: {out.error}" if out.param else out.error or "generation failed")
            resp = generate_pb2.GenerateResponse(token_ids=out.token_ids, text=out.text,
                                                 finish_reason=out.finish_reason or "")
            if parsed is not None:  # chat: the answer, its reasoning and its tool calls apart
                delta = parsed.feed(out.text) if out.text else None
                if out.finish_reason is not None:
                    delta = merge_deltas(delta, parsed.finish())
                    if out.finish_reason == "stop" and parsed.has_calls:
                        resp.finish_reason = "tool_calls"
                delta = delta or {}
                resp.text, resp.reasoning = delta.get("content", ""), delta.get("reasoning_content", "")
                for c in delta.get("tool_calls", ()):
                    fn = c.get("function", {})
                    resp.tool_calls.add(index=c["index"], id=c.get("id", ""), name=fn.get("name", ""),
                                        arguments=fn.get("arguments", ""))
            for x in out.logprobs or ():
                resp.logprobs.add(token_id=x.token, logprob=x.logprob,
                                  top=[generate_pb2.TopLogprob(token_id=t, logprob=v) for t, v in x.top])
            if out.finish_reason is not None:
                resp.usage.CopyFrom(generate_pb2.Usage(
                    prompt_tokens=h.prompt_tokens, completion_tokens=h.completion_tokens,
                    total_tokens=h.prompt_tokens + h.completion_tokens, cached_tokens=h.cached_tokens))
            yield resp


def create_server(engine: Engine, tokenizer=None, host: str = "127.0.0.1", port: int = 50050,
                  max_workers: int = 64, api_key: str | None = None, tls=None,
                  max_prompt_chars: int | None = None, chat_settings: ChatSettings | None = None,
                  options: list | None = None, image_policy=None) -> tuple[grpc.Server, int]:
    """Build and start the gRPC server; returns (server, bound port). More than `max_workers` RPCs at
    once: RESOURCE_EXHAUSTED, not a queue."""
    interceptors = [AuthInterceptor(api_key)] if api_key is not None else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="moesplit-grpc"),
                         interceptors=interceptors, maximum_concurrent_rpcs=max_workers,
                         options=options or [])
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(engine, tokenizer, max_prompt_chars, chat_settings,
                                                                             image_policy),
                                                            server)
    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    addr = f"{host}:{port}"
    bound = server.add_secure_port(addr, tls.credentials()) if tls is not None else server.add_insecure_port(addr)
    if bound == 0:
        raise OSError(f"cannot bind the gRPC API to {host}:{port}; pick another --grpc-port")
    for name in ("", SERVICE_NAME):
        hs.set(name, health_pb2.HealthCheckResponse.SERVING)
    server.health_servicer = hs  # so shutdown can flip to NOT_SERVING first
    server.start()
    return server, bound


class ApiTLS:
    """TLS of the Generate port (`--grpc-tls-cert/--grpc-tls-key`, `--grpc-tls-ca` to require client
    certificates signed by it). Files are read when the server starts: a bad path fails there."""

    def __init__(self, cert: str, key: str, ca: str | None = None):
        self.cert, self.key, self.ca = cert, key, ca

    @staticmethod
    def from_args(cert: str | None, key: str | None, ca: str | None) -> "ApiTLS | None":
        if not (cert or key or ca):
            return None
        if not (cert and key):
            raise ValueError("TLS on the gRPC API needs both --grpc-tls-cert and --grpc-tls-key")
        return ApiTLS(cert, key, ca)

    def credentials(self) -> grpc.ServerCredentials:
        def read(flag, path):
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as e:
                raise ValueError(f"{flag} {path}: cannot read ({e.strerror})") from None

        cert, key = read("--grpc-tls-cert", self.cert), read("--grpc-tls-key", self.key)
        ca = read("--grpc-tls-ca", self.ca) if self.ca else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)
