"""text-embeddings-inference's own routes, where TEI serves them and where its clients call them:

- POST / (and /invocations, SageMaker's path) answers as TEI does for the model it serves: an embedding
  model embeds (huggingface_hub's InferenceClient.feature_extraction, LangChain's
  HuggingFaceEndpointEmbeddings, Haystack's TEI embedders), a cross-encoder reranks, a classifier of
  several labels predicts (InferenceClient.text_classification). An embedding model also answers
  {"inputs": {"source_sentence", "sentences"}} there with /similarity's answer, as
  InferenceClient.sentence_similarity sends it (TEI needs TASK=sentence-similarity for that);
- POST /similarity: the cosine of each sentence's embedding with the source sentence's;
- under /tei, TEI's own paths for clients that call them by name, where this server's /embed answers in
  its own shape: /tei/embed (llama-index's TextEmbeddingsInference), /tei/embed_all, and /tei itself,
  /tei/similarity, /tei/rerank and /tei/predict as above. A TEI client is given URL/tei.

Embeddings are pooled as the model's makers meant (GET /info `default_pooling`, Dense layers included)."""
from __future__ import annotations

from typing import Annotated

import numpy as np
from fastapi import APIRouter, Body, Depends, Request
from starlette.responses import Response

from app.errors import TooManyInputs
from app.pooling import POOLING_OUTPUT
from app.responses import json_response, json_response_off_loop
from app.routes import DirectRoute, JsonObject, ServiceRoute, get_service, require_api_key, validate_body
from app.routes.classify import predict, rerank, rerank_either, rerank_route
from app.schemas import (SERVICE_ERROR_RESPONSES, DocumentsRerankResponse, Prediction, PredictRequest, Rank,
                         RerankRequest, SimilarityParameters, TeiEmbedAllRequest, TeiEmbedRequest,
                         TeiSimilarityRequest, as_items)
from app.service import InferenceService
from app.tokenization import ItemNames
from artifact.manifest import TOKEN_EMBEDDINGS

router = APIRouter(route_class=ServiceRoute, dependencies=[Depends(require_api_key)], tags=["tei"])

PREFIX = "/tei"
ROOT_PATHS = ("/", "/invocations", PREFIX, PREFIX + "/")


async def tei_embed(body: TeiEmbedRequest, request: Request, service: InferenceService) -> Response:
    """text-embeddings-inference's /embed: `inputs` a text or a list of texts; answers [[float, ...], ...]."""
    inputs = as_items(body.inputs)
    prompt = service.prompt_for(inputs, body.prompt_name)
    pooling = service.manifest.default_pooling
    service.check_dimensions(body.dimensions, pooling)
    result = await service.infer(request, inputs, body.truncates, frozenset({POOLING_OUTPUT[pooling]}), "inputs",
                                 direction=body.direction, prompt=prompt)
    vectors = service.sentence_vectors(result.outputs, pooling, body.normalize, body.dimensions)
    return json_response(np.ascontiguousarray(vectors, dtype=np.float32), headers=result.timings.headers())


async def tei_embed_route(body: TeiEmbedRequest, request: Request,
                          service: InferenceService = Depends(get_service)) -> Response:
    """text-embeddings-inference's /embed: `inputs` a text or a list of texts; answers [[float, ...], ...] in
    the model's default pooling, normalised unless `normalize` is false."""
    return await tei_embed(body, request, service)


async def tei_embed_all(body: TeiEmbedAllRequest, request: Request,
                        service: InferenceService = Depends(get_service)) -> Response:
    """text-embeddings-inference's /embed_all: every token's vector of each input, [CLS] and [SEP]
    included, [[[float, ...], ...], ...]."""
    inputs = as_items(body.inputs)
    result = await service.infer(request, inputs, body.truncates, frozenset({TOKEN_EMBEDDINGS}), "inputs",
                                 direction=body.direction, prompt=service.prompt_for(inputs, body.prompt_name),
                                 answers_token_vectors=True)
    tokens = [np.ascontiguousarray(t, dtype=np.float32) for t in result.outputs[TOKEN_EMBEDDINGS]]
    return await json_response_off_loop(tokens, headers=result.timings.headers())


@router.post("/similarity", response_model=list[float], responses=SERVICE_ERROR_RESPONSES)
async def similarity(body: TeiSimilarityRequest, request: Request,
                     service: InferenceService = Depends(get_service)) -> Response:
    """The cosine of each of `sentences`' embeddings with `source_sentence`'s, in their order."""
    parameters = body.parameters or SimilarityParameters()
    limit = service.settings.max_inputs_per_request
    if len(body.inputs.sentences) + 1 > limit:  # counted with the source sentence, which is embedded too
        raise TooManyInputs(f"inputs.sentences has {len(body.inputs.sentences)} sentences; with the source sentence "
                            f"the server accepts at most {limit - 1}")
    texts = [body.inputs.source_sentence, *body.inputs.sentences]
    field = ItemNames("inputs", ["inputs.source_sentence", *(f"inputs.sentences[{i}]" for i in range(len(texts) - 1))])
    pooling = service.manifest.default_pooling
    result = await service.infer(request, texts, parameters.truncates, frozenset({POOLING_OUTPUT[pooling]}),
                                 field, direction=parameters.direction,
                                 prompt=service.prompt_for(texts, parameters.prompt_name))
    vectors = service.sentence_vectors(result.outputs, pooling, normalize=True)
    cosines = np.clip(vectors[1:] @ vectors[0], -1.0, 1.0)  # unit vectors' products stray past 1 by rounding
    return json_response(cosines.astype(np.float32), headers=result.timings.headers())


async def tei_root(body: JsonObject, request: Request, service: InferenceService) -> Response:
    """The route TEI serves at / for this model, the body read as that route's."""
    labels = service.manifest.classifier_labels
    if labels:
        model, endpoint = (RerankRequest, rerank) if len(labels) == 1 else (PredictRequest, predict)
    elif isinstance(body.root.get("inputs"), dict):
        model, endpoint = TeiSimilarityRequest, similarity
    else:
        model, endpoint = TeiEmbedRequest, tei_embed
    return await endpoint(validate_body(model, body.root), request, service)


async def tei_root_route(body: Annotated[TeiEmbedRequest | TeiSimilarityRequest | RerankRequest | PredictRequest,
                                         Body()],
                         request: Request, service: InferenceService = Depends(get_service)) -> Response:
    """As text-embeddings-inference answers it for the model served: an embedding model embeds (`inputs` a
    text or a list: [[float, ...], ...]), or with `inputs` {source_sentence, sentences} answers as
    /similarity; a cross-encoder (one label) answers as /rerank; a classifier of several labels as /predict.
    (For the docs and HEAD: the serving front answers POST with tei_root itself.)"""
    return await tei_root(JsonObject(await request.json()), request, service)


for path in ROOT_PATHS:
    router.add_api_route(path, tei_root_route, methods=["POST"], responses=SERVICE_ERROR_RESPONSES,
                         response_model=list[list[float]] | list[float] | list[Rank] | list[Prediction]
                         | list[list[Prediction]])

# TEI's paths under PREFIX: (the route, for the docs and HEAD; the serving front's fast path; the answer)
_PREFIXED = {"/embed": (tei_embed_route, DirectRoute(tei_embed, TeiEmbedRequest), list[list[float]]),
             "/embed_all": (tei_embed_all, DirectRoute(tei_embed_all, TeiEmbedAllRequest), list[list[list[float]]]),
             "/similarity": (similarity, DirectRoute(similarity, TeiSimilarityRequest), list[float]),
             "/rerank": (rerank_route, DirectRoute(rerank_either, JsonObject), list[Rank] | DocumentsRerankResponse),
             "/predict": (predict, DirectRoute(predict, PredictRequest), list[Prediction] | list[list[Prediction]])}
for path, (endpoint, _, answer) in _PREFIXED.items():
    router.add_api_route(PREFIX + path, endpoint, methods=["POST"], response_model=answer,
                         responses=SERVICE_ERROR_RESPONSES)

DIRECT_ROUTES = {path: DirectRoute(tei_root, JsonObject) for path in ROOT_PATHS} | {
    "/similarity": _PREFIXED["/similarity"][1]} | {PREFIX + path: direct for path, (_, direct, _) in _PREFIXED.items()}
