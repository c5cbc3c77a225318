"""GET /v1/models: the one served model, with its longest request (`max_model_len`, vLLM's field)."""
from __future__ import annotations

from fastapi import APIRouter

from gpu_service.api.routes.context import ApiContext


def router(ctx: ApiContext) -> APIRouter:
    """The models route over `ctx`."""
    r = APIRouter()

    @r.get("/v1/models")
    async def models():
        """OpenAI's model list, of one."""
        return {"object": "list", "data": [{
            "id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "moesplit",
            "max_model_len": ctx.engine.max_request_tokens}]}

    return r
