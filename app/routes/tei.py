"""POST /: text-embeddings-inference's embed route, where TEI serves it and where its clients call it
(huggingface_hub's InferenceClient.feature_extraction, LangChain's HuggingFaceEndpointEmbeddings,
Haystack's TEI embedders): a list of embeddings, one list of floats per text, pooled as the model's
makers meant (GET /info `default_pooling`, the model's Dense layers included) and normalised by default."""
from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from app.pooling import POOLING_OUTPUT
from app.responses import json_response
from app.routes import DirectRoute, ServiceRoute, get_service, require_api_key
from app.schemas import SERVICE_ERROR_RESPONSES, TeiEmbedRequest
from app.service import InferenceService

router = APIRouter(route_class=ServiceRoute, dependencies=[Depends(require_api_key)], tags=["tei"])


@router.post("/", response_model=list[list[float]], responses=SERVICE_ERROR_RESPONSES)
async def tei_embed(body: TeiEmbedRequest, request: Request,
                    service: InferenceService = Depends(get_service)) -> Response:
    """text-embeddings-inference's /embed: `inputs` a text or a list of texts; answers [[float, ...], ...]."""
    inputs = service.prompted([body.inputs] if isinstance(body.inputs, str) else body.inputs, body.prompt_name,
                              "inputs", body.direction)
    pooling = service.manifest.default_pooling
    service.check_dimensions(body.dimensions, pooling)
    result = await service.infer(request, inputs, body.truncates, frozenset({POOLING_OUTPUT[pooling]}), "inputs",
                                 direction=body.direction)
    vectors = service.sentence_vectors(result.outputs, pooling, body.normalize, body.dimensions)
    return json_response(np.ascontiguousarray(vectors, dtype=np.float32), headers=result.timings.headers())


DIRECT_ROUTES = {"/": DirectRoute(tei_embed, TeiEmbedRequest)}
