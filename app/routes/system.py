"""GET /health, /ready, /info and /metrics."""
from __future__ import annotations

import os

from fastapi import APIRouter, Depends, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import PlainTextResponse, Response

from app.errors import ShuttingDown
from app.pooling import available_poolings
from app.responses import json_response
from app.routes import ServiceRoute, get_and_head, get_service, require_api_key
from app.schemas import ERROR_RESPONSES
from app.service import InferenceService

router = APIRouter(route_class=ServiceRoute, tags=["system"])


@get_and_head(router, "/health")
@get_and_head(router, "/ping")  # SageMaker's health path, as text-embeddings-inference serves it
async def health() -> Response:
    """The process is alive (says nothing about the model: see /ready)."""
    return json_response({"status": "ok"})


@get_and_head(router, "/ready", responses={503: ERROR_RESPONSES[503]})
async def ready(service: InferenceService = Depends(get_service)) -> Response:
    """200 once the model is loaded and a real forward pass succeeded; 503 before and while shutting down."""
    if service.draining:
        raise ShuttingDown("the server is shutting down")
    return json_response({"status": "ready", "model": service.model_name})


@get_and_head(router, "/info", dependencies=[Depends(require_api_key)], responses=ERROR_RESPONSES)
async def info(service: InferenceService = Depends(get_service)) -> Response:
    """The model and how it is served."""
    m, s, e = service.manifest, service.settings, service.engine
    return json_response({
        "model": service.model_name,
        "dimensions": m.sentence_width,  # of the default pooling's vectors (a Dense module may change it)
        "hidden_size": m.hidden_size,  # of token vectors and of the other poolings
        "max_length": m.max_length,  # longer inputs are cut there (or answered 413 with truncate: false)
        "truncation_direction": m.truncation_direction,  # the end cut unless a request says (tokenizer_config's)
        "max_position_embeddings": m.max_position_embeddings,
        "default_pooling": m.default_pooling,  # what /embed does without `pooling`
        "default_normalize": m.default_normalize,
        "prompts": m.prompts,  # name -> text put before a text: /embed's `prompt_name`
        "default_prompt_name": m.default_prompt_name,  # put before every text unless a request names another
        "num_layers": m.num_layers,
        "num_heads": m.num_heads,
        "vocab_size": m.vocab_size,
        "lowercase": m.lowercase,
        "has_pooler": m.has_pooler,
        "has_nsp_head": m.has_nsp_head,
        "classifier_labels": m.classifier_labels,  # a sequence classifier's (/rerank, /predict); [] for an encoder
        "classifier_scoring": m.classifier_scoring,  # auto (sigmoid for one label, softmax), sigmoid, logits
        "poolings": available_poolings(m.has_pooler),
        "device": e.device,
        "precision": e.precision,
        "provider": e.provider,
        "custom_kernels": e.custom_kernels,  # the fp16 graph on our fused operators (custom_kernels/)
        "cuda_graphs": e.cuda_graphs,  # small batches replay CUDA graphs (app/cuda_graphs.py)
        "artifact": {"format_version": m.format_version, "created_at": m.created_at,
                     "weights_sha256": m.weights_sha256,
                     # `python -m app` checks every one before it starts and refuses to start on a difference
                     "files_sha256": m.files_sha256,
                     "versions": m.versions},
        "limits": {
            "max_batch_tokens": service.batcher.max_batch_tokens, "max_batch_size": s.max_batch_size,
            "max_wait_ms": s.max_wait_ms, "max_queued_sequences": s.max_queued_sequences,
            "max_concurrent_requests": s.max_concurrent_requests,
            "max_inputs_per_request": s.max_inputs_per_request, "max_input_chars": s.max_input_chars,
            "max_request_bytes": s.max_request_bytes, "inference_workers": service.batcher.inference_workers,
            "intra_op_threads": e.intra_op_threads, "workers": s.workers,
        },
        "openai": {"pooling": service.openai_pooling, "normalize": service.openai_normalize},
        "auth": s.api_key is not None,
        "pid": os.getpid(),  # which of the HTTP worker processes answered
        "engine_pid": e.pid,  # the process that holds the session
    })


@get_and_head(router, "/metrics", response_class=PlainTextResponse,
              responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    """Prometheus text exposition format (not JSON), summed over every process of the server."""
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
