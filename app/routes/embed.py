"""POST /embed and POST /tokenize."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from app.errors import Unsupported
from app.pooling import POOLING_OUTPUT, encode_rows, encode_vectors
from app.responses import json_response, json_response_off_loop
from app.routes import DirectRoute, ServiceRoute, get_service, require_api_key
from app.schemas import SERVICE_ERROR_RESPONSES, EmbedRequest, EmbedResponse, TokenizeRequest, TokenizeResponse, as_items
from app.service import InferenceService
from app.tokenization import describe_tokens
from artifact.manifest import TOKEN_EMBEDDINGS

router = APIRouter(route_class=ServiceRoute, dependencies=[Depends(require_api_key)], tags=["embeddings"])


@router.post("/embed", response_model=EmbedResponse, responses=SERVICE_ERROR_RESPONSES)
async def embed(body: EmbedRequest, request: Request, service: InferenceService = Depends(get_service)) -> Response:
    """Embed texts or sentence pairs; optionally return every token with its vector."""
    pooling = body.pooling or service.manifest.default_pooling
    normalize = service.manifest.default_normalize if body.normalize is None else body.normalize
    if pooling == "pooled" and not service.manifest.has_pooler:
        raise Unsupported("this model has no pooler: use another pooling (GET /info lists them)")
    outputs = {POOLING_OUTPUT[pooling]} if pooling != "none" else set()
    if body.return_tokens:
        outputs.add(TOKEN_EMBEDDINGS)
    items = as_items(body.inputs)
    result = await service.infer(request, items, body.truncate, frozenset(outputs), "inputs",
                                 offsets=body.return_tokens, direction=body.truncation_direction,
                                 prompt=service.prompt_for(items, body.prompt_name),
                                 answers_token_vectors=body.return_tokens)
    fmt = body.encoding_format
    embeddings: list = [None] * len(result.tokenized)
    if pooling != "none":  # the whole request's vectors at once
        embeddings = encode_rows(service.sentence_vectors(result.outputs, pooling, normalize), fmt)
    if body.return_tokens:
        token_vectors = result.outputs[TOKEN_EMBEDDINGS]
        data = [{"index": i, "embedding": embeddings[i], "tokens": describe_tokens(enc),
                 "token_embeddings": encode_vectors(token_vectors[i], fmt)}
                for i, enc in enumerate(result.tokenized.encodings)]
        return await json_response_off_loop({"model": service.model_name, "data": data,
                                             "usage": {"tokens": result.tokens}}, headers=result.timings.headers())
    data = [{"index": i, "embedding": e} for i, e in enumerate(embeddings)]
    return json_response({"model": service.model_name, "data": data, "usage": {"tokens": result.tokens}},
                         headers=result.timings.headers())


@router.post("/tokenize", response_model=TokenizeResponse, responses=SERVICE_ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, request: Request,
                   service: InferenceService = Depends(get_service)) -> Response:
    """The tokens /embed would see: id, token, segment, character offsets in its own text, special."""
    with service.admitted():
        items = as_items(body.inputs)
        tokenized, seconds = await service.tokenize(items, body.truncate, "inputs", direction=body.truncation_direction,
                                                    prompt=service.prompt_for(items, body.prompt_name))
    data = [{"index": i, "tokens": describe_tokens(enc)} for i, enc in enumerate(tokenized.encodings)]
    return json_response({"model": service.model_name, "data": data, "usage": {"tokens": tokenized.tokens}},
                         headers={"x-tokenize-ms": f"{seconds * 1e3:.3f}"})


DIRECT_ROUTES = {"/embed": DirectRoute(embed, EmbedRequest), "/tokenize": DirectRoute(tokenize, TokenizeRequest)}
