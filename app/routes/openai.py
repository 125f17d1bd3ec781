"""POST /v1/embeddings (and /embeddings), compatible with OpenAI's API and client (texts only; truncates to
max length); GET /v1/models (and /models) and /v1/models/NAME, the one model, where OpenAI-compatible tools
look for it."""
from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from app.errors import NotFound, Unsupported
from app.pooling import POOLING_OUTPUT, encode_rows
from app.responses import json_response
from app.routes import DirectRoute, ServiceRoute, get_service, require_api_key
from app.schemas import (ERROR_RESPONSES, SERVICE_ERROR_RESPONSES, ErrorResponse, OpenAIEmbeddingRequest,
                         OpenAIEmbeddingResponse)
from app.service import InferenceService

router = APIRouter(route_class=ServiceRoute, dependencies=[Depends(require_api_key)], tags=["openai"])


@router.post("/v1/embeddings", response_model=OpenAIEmbeddingResponse,
             responses=SERVICE_ERROR_RESPONSES)
async def embeddings(body: OpenAIEmbeddingRequest, request: Request,
                     service: InferenceService = Depends(get_service)) -> Response:
    """Pooled and normalised as the model's defaults say, unless the openai_pooling / openai_normalize
    settings say otherwise; `dimensions` keeps the first that many (for Matryoshka-trained models)."""
    inputs = [body.input] if isinstance(body.input, str) else body.input
    if any(not isinstance(x, str) for x in inputs):
        raise Unsupported("token-id inputs are not supported (their ids come from another tokenizer): send text "
                          "(LangChain's OpenAIEmbeddings sends ids unless check_embedding_ctx_length=False)")
    pooling = service.openai_pooling
    service.check_dimensions(body.dimensions, pooling)
    result = await service.infer(request, inputs, True, frozenset({POOLING_OUTPUT[pooling]}), "input",
                                 prompt=service.prompt_for(inputs, None))  # the model's default prompt, if any
    vectors = service.sentence_vectors(result.outputs, pooling, service.openai_normalize, body.dimensions)
    data = [{"object": "embedding", "index": i, "embedding": e}
            for i, e in enumerate(encode_rows(vectors, body.encoding_format or "float"))]
    usage = {"prompt_tokens": result.tokens, "total_tokens": result.tokens}
    return json_response({"object": "list", "data": data, "model": service.model_name, "usage": usage},
                         headers=result.timings.headers())


# The same route without the version prefix, as text-embeddings-inference and infinity also serve it: for
# clients given the server's bare URL as their base URL.
router.add_api_route("/embeddings", embeddings, methods=["POST"], include_in_schema=False)

@router.get("/v1/models", responses=ERROR_RESPONSES)
async def models(service: InferenceService = Depends(get_service)) -> Response:
    """The server's one model, as OpenAI lists models: what `model` may name (any name is accepted)."""
    return json_response({"object": "list", "data": [_model_object(service)]})


def _model_object(service: InferenceService) -> dict:
    try:
        created = int(datetime.fromisoformat(service.manifest.created_at).timestamp())
    except ValueError:
        created = 0
    return {"id": service.model_name, "object": "model", "created": created, "owned_by": "bertserve"}


@router.get("/v1/models/{model_id:path}", responses={404: {"model": ErrorResponse}, **ERROR_RESPONSES})
async def model(model_id: str, service: InferenceService = Depends(get_service)) -> Response:
    """The model by its name, as OpenAI's models.retrieve reads it; 404 for any other name."""
    listed = _model_object(service)
    if model_id != listed["id"]:
        raise NotFound(f"no model {model_id!r} here: this server serves {listed['id']!r} (/v1/embeddings takes "
                       f"any model name)")
    return json_response(listed)


router.add_api_route("/models", models, methods=["GET"], include_in_schema=False)
router.add_api_route("/models/{model_id:path}", model, methods=["GET"], include_in_schema=False)

DIRECT_ROUTES = {path: DirectRoute(embeddings, OpenAIEmbeddingRequest) for path in ("/v1/embeddings", "/embeddings")}
