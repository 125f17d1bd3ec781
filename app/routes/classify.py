"""A fine-tuned sequence classifier's head (GET /info `classifier_labels`). A cross-encoder (one label)
scores (query, text) pairs: POST /rerank as text-embeddings-inference answers it, and POST /v1/rerank and
/v2/rerank as Cohere's and Jina's APIs do (their clients, and the rerankers of LangChain, llama-index, Dify
or Open WebUI given the server's URL; /rerank takes their `documents` body too, as infinity and vLLM serve
it there). POST /predict gives every label's score for texts or pairs, as TEI answers it."""
from __future__ import annotations

import time
import uuid
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Body, Depends, Request
from starlette.responses import Response

from app.errors import InvalidInput, Unsupported
from app.pooling import softmax
from app.responses import json_response
from app.routes import DirectRoute, JsonObject, ServiceRoute, get_service, require_api_key, validate_body
from app.schemas import (SERVICE_ERROR_RESPONSES, DocumentsRerankRequest, DocumentsRerankResponse, Prediction,
                         PredictRequest, Rank, RerankRequest)
from app.service import InferenceService
from app.tokenization import ItemNames
from artifact.manifest import CLASSIFIER_LOGITS

router = APIRouter(route_class=ServiceRoute, dependencies=[Depends(require_api_key)], tags=["classifier"])


def scores(logits: np.ndarray, raw: bool, scoring: str = "auto") -> np.ndarray:
    """[n, labels] logits -> what is answered (artifact.manifest.CLASSIFIER_SCORINGS): the logits themselves
    (raw, or a regression's), a sigmoid for one label (a cross-encoder's relevance) or for each label of a
    multi-label classifier, else a softmax over several (as text-embeddings-inference scores them)."""
    if raw or scoring == "logits":
        return logits.astype(np.float64)
    if logits.shape[-1] == 1 or scoring == "sigmoid":
        return 1 / (1 + np.exp(-logits.astype(np.float64)))
    return softmax(logits)


def _labels(service: InferenceService) -> list[str]:
    labels = service.manifest.classifier_labels
    if not labels:
        raise Unsupported("this model has no sequence-classification head: /rerank and /predict need a "
                          "cross-encoder or a classifier (BertForSequenceClassification), exported as it is")
    return labels


async def relevance(service: InferenceService, request: Request, query: str, texts: list[str], field: str,
                    truncate: bool = True, direction: str | None = None, raw: bool = False):
    """(each text's score against the query, the inference result): a cross-encoder's score of each
    [query, text] pair."""
    labels = _labels(service)
    if len(labels) != 1:
        raise Unsupported(f"this model classifies into {len(labels)} labels ({', '.join(labels)}), it is not a "
                          f"cross-encoder with one score: use /predict")
    # named as the request names them, before they become [query, text] pairs
    service.tokenizer.check_text(query, "query")
    for i, text in enumerate(texts):
        service.tokenizer.check_text(text, f"{field}[{i}]")
    # an over-long pair is named as the pair it is: the query may be what makes it too long
    pairs = ItemNames(field, [f"[query, {field}[{i}]]" for i in range(len(texts))])
    result = await service.infer(request, [(query, text) for text in texts], truncate, frozenset({CLASSIFIER_LOGITS}),
                                 pairs, direction=direction)
    return scores(result.outputs[CLASSIFIER_LOGITS], raw)[:, 0], result


async def rerank(body: RerankRequest, request: Request, service: InferenceService) -> Response:
    """The texts by relevance to the query, most relevant first, as TEI answers them."""
    ranked, result = await relevance(service, request, body.query, body.texts, "texts", body.truncates,
                                     body.direction, body.raw_scores)
    order = np.argsort(-ranked, kind="stable").tolist()
    answer = [{"index": i, "score": float(ranked[i]), **({"text": body.texts[i]} if body.return_text else {})}
              for i in order]
    return json_response(answer, headers=result.timings.headers())


@router.post("/v1/rerank", response_model=DocumentsRerankResponse, responses=SERVICE_ERROR_RESPONSES)
async def rerank_documents(body: DocumentsRerankRequest, request: Request,
                           service: InferenceService = Depends(get_service)) -> Response:
    """The documents by relevance to the query, most relevant first (the first `top_n`), as Cohere's and
    Jina's rerank APIs answer them."""
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    ranked, result = await relevance(service, request, body.query, texts, "documents", raw=body.raw_scores)
    order = np.argsort(-ranked, kind="stable").tolist()[:body.top_n]
    results = [{"index": i, "relevance_score": float(ranked[i]),
                **({"document": {"text": texts[i]}} if body.return_documents else {})} for i in order]
    # Each API's own fields, so that each client's parser finds what it requires: Cohere's meta, Jina's and
    # vLLM's usage, infinity's object and created.
    return json_response({"object": "rerank", "id": str(uuid.uuid4()), "created": int(time.time()),
                          "model": service.model_name, "results": results,
                          "usage": {"prompt_tokens": result.tokens, "total_tokens": result.tokens},
                          "meta": {"billed_units": {"search_units": 1}}}, headers=result.timings.headers())


router.add_api_route("/v2/rerank", rerank_documents, methods=["POST"], response_model=DocumentsRerankResponse,
                     responses=SERVICE_ERROR_RESPONSES, name="rerank_documents_v2")


async def rerank_either(body: JsonObject, request: Request, service: InferenceService) -> Response:
    """/rerank's body read as Cohere's and Jina's when it has `documents` and no `texts`, else as TEI's."""
    if "documents" in body.root and "texts" in body.root:  # which list to rank is the client's to say
        raise InvalidInput("give the texts to rank as `texts` (text-embeddings-inference) or as `documents` "
                           "(Cohere, Jina), not both")
    if "documents" in body.root:
        return await rerank_documents(validate_body(DocumentsRerankRequest, body.root), request, service)
    return await rerank(validate_body(RerankRequest, body.root), request, service)


@router.post("/rerank", response_model=list[Rank] | DocumentsRerankResponse, responses=SERVICE_ERROR_RESPONSES)
async def rerank_route(body: Annotated[RerankRequest | DocumentsRerankRequest, Body()], request: Request,
                       service: InferenceService = Depends(get_service)) -> Response:
    """The texts by relevance to the query, most relevant first: with `texts`, as text-embeddings-inference
    answers ([{"index", "score", "text"?}]); with `documents`, as /v1/rerank answers. (For the docs: the
    serving front answers POST with rerank_either itself.)"""
    return await rerank_either(JsonObject(await request.json()), request, service)


@router.post("/predict", response_model=list[Prediction] | list[list[Prediction]], responses=SERVICE_ERROR_RESPONSES)
async def predict(body: PredictRequest, request: Request,
                  service: InferenceService = Depends(get_service)) -> Response:
    """Every label with its score, highest first, for a text or a pair [text_a, text_b]; a list of them
    for a batch."""
    labels = _labels(service)
    single = isinstance(body.inputs, str) or (len(body.inputs) > 0 and isinstance(body.inputs[0], str))
    batch = [body.inputs] if single else body.inputs
    items = [x if isinstance(x, str) else x[0] if len(x) == 1 else (x[0], x[1]) for x in batch]
    result = await service.infer(request, items, body.truncates, frozenset({CLASSIFIER_LOGITS}), "inputs",
                                 direction=body.direction)
    answer = [[{"score": float(row[k]), "label": labels[k]} for k in np.argsort(-row, kind="stable").tolist()]
              for row in scores(result.outputs[CLASSIFIER_LOGITS], body.raw_scores,
                                service.manifest.classifier_scoring)]
    return json_response(answer[0] if single else answer, headers=result.timings.headers())


DIRECT_ROUTES = {"/rerank": DirectRoute(rerank_either, JsonObject), "/predict": DirectRoute(predict, PredictRequest),
                 "/v1/rerank": DirectRoute(rerank_documents, DocumentsRerankRequest),
                 "/v2/rerank": DirectRoute(rerank_documents, DocumentsRerankRequest)}
