"""POST /rerank and POST /predict: a fine-tuned sequence classifier's head (GET /info `classifier_labels`),
as text-embeddings-inference answers them. A cross-encoder (one label) scores (query, text) pairs for
/rerank; /predict gives every label's score for texts or pairs."""
from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from app.errors import Unsupported
from app.pooling import softmax
from app.responses import json_response
from app.routes import DirectRoute, ServiceRoute, get_service, require_api_key
from app.schemas import SERVICE_ERROR_RESPONSES, Prediction, PredictRequest, Rank, RerankRequest
from app.service import InferenceService
from artifact.manifest import CLASSIFIER_LOGITS

router = APIRouter(route_class=ServiceRoute, dependencies=[Depends(require_api_key)], tags=["classifier"])


def scores(logits: np.ndarray, raw: bool) -> np.ndarray:
    """[n, labels] logits -> what is answered: the logits themselves, else a sigmoid for one label (a
    cross-encoder's relevance) and a softmax over several (as text-embeddings-inference scores them)."""
    if raw:
        return logits.astype(np.float64)
    if logits.shape[-1] == 1:
        return 1 / (1 + np.exp(-logits.astype(np.float64)))
    return softmax(logits)


def _labels(service: InferenceService) -> list[str]:
    labels = service.manifest.classifier_labels
    if not labels:
        raise Unsupported("this model has no sequence-classification head: /rerank and /predict need a "
                          "cross-encoder or a classifier (BertForSequenceClassification), exported as it is")
    return labels


@router.post("/rerank", response_model=list[Rank], responses=SERVICE_ERROR_RESPONSES)
async def rerank(body: RerankRequest, request: Request, service: InferenceService = Depends(get_service)) -> Response:
    """The texts by relevance to the query, most relevant first: a cross-encoder's score of each
    [query, text] pair."""
    labels = _labels(service)
    if len(labels) != 1:
        raise Unsupported(f"this model classifies into {len(labels)} labels ({', '.join(labels)}), it is not a "
                          f"cross-encoder with one score: use /predict")
    pairs = [(body.query, text) for text in body.texts]
    result = await service.infer(request, pairs, body.truncates, frozenset({CLASSIFIER_LOGITS}), "texts",
                                 direction=body.direction)
    ranked = scores(result.outputs[CLASSIFIER_LOGITS], body.raw_scores)[:, 0]
    order = np.argsort(-ranked, kind="stable").tolist()
    answer = [{"index": i, "score": float(ranked[i]), **({"text": body.texts[i]} if body.return_text else {})}
              for i in order]
    return json_response(answer, headers=result.timings.headers())


@router.post("/predict", response_model=list[Prediction] | list[list[Prediction]], responses=SERVICE_ERROR_RESPONSES)
async def predict(body: PredictRequest, request: Request,
                  service: InferenceService = Depends(get_service)) -> Response:
    """Every label with its score, highest first, for a text or a pair [text_a, text_b]; a list of them
    for a batch."""
    labels = _labels(service)
    single = isinstance(body.inputs, str) or isinstance(body.inputs[0], str)
    batch = [body.inputs] if single else body.inputs
    items = [x if isinstance(x, str) else x[0] if len(x) == 1 else (x[0], x[1]) for x in batch]
    result = await service.infer(request, items, body.truncates, frozenset({CLASSIFIER_LOGITS}), "inputs",
                                 direction=body.direction)
    answer = [[{"score": float(row[k]), "label": labels[k]} for k in np.argsort(-row, kind="stable").tolist()]
              for row in scores(result.outputs[CLASSIFIER_LOGITS], body.raw_scores)]
    return json_response(answer[0] if single else answer, headers=result.timings.headers())


DIRECT_ROUTES = {"/rerank": DirectRoute(rerank, RerankRequest), "/predict": DirectRoute(predict, PredictRequest)}
