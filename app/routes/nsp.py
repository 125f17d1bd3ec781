"""POST /nsp: next-sentence prediction with the model's pre-training head."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from app.errors import Unsupported
from app.pooling import softmax
from app.responses import json_response
from app.routes import DirectRoute, ServiceRoute, get_service, require_api_key
from app.schemas import SERVICE_ERROR_RESPONSES, NspRequest, NspResponse
from app.service import InferenceService
from artifact.manifest import NSP_LOGITS

router = APIRouter(route_class=ServiceRoute, dependencies=[Depends(require_api_key)], tags=["nsp"])


@router.post("/nsp", response_model=NspResponse, responses=SERVICE_ERROR_RESPONSES)
async def nsp(body: NspRequest, request: Request, service: InferenceService = Depends(get_service)) -> Response:
    """For each [text_a, text_b]: the probability that B follows A, and the raw [is_next, not_next] logits."""
    if not service.manifest.has_nsp_head:
        raise Unsupported("this model has no next-sentence-prediction head: the checkpoint it was exported from "
                          "has none (BertForPreTraining and BertForNextSentencePrediction checkpoints have one)")
    pairs = [(a, b) for a, b in body.pairs]
    result = await service.infer(request, pairs, body.truncate, frozenset({NSP_LOGITS}), "pairs")
    logits = result.outputs[NSP_LOGITS]  # [n, 2]
    is_next = softmax(logits)[:, 0].tolist()
    data = [{"index": i, "is_next": p, "logits": row} for i, (p, row) in enumerate(zip(is_next, logits))]
    return json_response({"model": service.model_name, "data": data, "usage": {"tokens": result.tokens}},
                         headers=result.timings.headers())


DIRECT_ROUTES = {"/nsp": DirectRoute(nsp, NspRequest)}
