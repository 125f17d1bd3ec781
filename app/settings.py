"""Every server setting, read from `python -m app` flags and BERTSERVE_* environment variables."""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from artifact.manifest import POOLINGS

ENV_PREFIX = "BERTSERVE_"


class Settings(BaseSettings):
    """Invalid values stop the server at startup with a message naming the setting."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True,
                                      protected_namespaces=())  # fields model_dir, model_name

    model_dir: Path = Field(description="artifact folder written by `python -m export` (manifest.json, "
                                        "tokenizer.json, ONNX graphs)")
    host: str = Field("127.0.0.1", description="address to listen on (the container image sets 0.0.0.0)")
    port: int = Field(8000, ge=1, le=65535, description="TCP port to listen on")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: CUDA when onnxruntime has the CUDA provider and the artifact an fp16 graph")
    precision: Literal["auto", "fp32", "fp16", "int8"] = Field(
        "auto", description="auto: fp16 on CUDA, fp32 on CPU; int8 is CPU only")
    cuda_device_id: int = Field(0, ge=0, description="which GPU (CUDA's numbering) holds the session")
    cuda_device_ids: str | None = Field(None, pattern=r"^\d+(,\d+)*$", description="several GPUs, e.g. 0,1: one "
                                        "engine process per GPU, the HTTP workers shared out among them (needs "
                                        "workers > 1: at least one per GPU); a GPU named twice (0,0) gets two "
                                        "engine processes. Empty: cuda_device_id alone")
    custom_kernels: Literal["auto", "on", "off"] = Field(
        "auto", description="CUDA: run the artifact's fp16 graph on our operators (GEMMs with their bias "
        "and GELU fused, and the packed graph's attention; custom_kernels/; its speed-up: BENCHMARKS.md). auto: when the artifact has "
        "that graph (export checked its parity) and the library is found (BERTSERVE_KERNELS_LIBRARY, or "
        "built in the checkout), else the plain graph; on: fail without them; off: never")
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "auto", description="CUDA: replay batches as CUDA graphs captured at start, from the graph python -m "
        "export --device cuda writes for them: with a packed graph (the default) every batch of up to "
        "max_batch_size texts and cuda_graph_tokens tokens that needs no token vectors (for a model that pools "
        "[CLS], a larger one too, uncaptured); with a padded one "
        "(--keep-padding), a batch of up to cuda_graph_rows texts that finds the GPU otherwise idle. A lone "
        "text is answered sooner and a batch costs less CPU, for GPU memory and start-up time (BENCHMARKS.md). "
        "auto: when the artifact has that graph; on: fail without it; off: never")
    cuda_graph_tokens: int | None = Field(None, ge=1, le=32768, description="CUDA, packed graphs: the largest "
                                          "batch (tokens) replayed from a CUDA graph; one is captured for each "
                                          "(rows, tokens) bucket up to it, about 1.25x apart. Default: the batch "
                                          "budget where the replayed graph runs its last layer for the [CLS] rows "
                                          "only (a model that pools [CLS]; a larger batch also runs there, "
                                          "uncaptured): one text per request 15% faster on an H200 than with 4096 "
                                          "(BERT-base). 4096 where it pools the mean: past it batches run on the "
                                          "packed graph, two at a time, 8% faster at 64 texts per request "
                                          "(all-MiniLM-L6-v2; BENCHMARKS.md)")
    cuda_graph_short_lengths: str | None = Field(
        "64,128", pattern=r"^\d+(,\d+)*$", description="CUDA, packed graphs: text lengths in tokens that get "
        "captured graphs of their own besides the model's longest: a batch whose longest text fits one replays a "
        "graph whose attention spans only that length, and packs and copies fewer offsets. 64,128 replayed "
        "one-text traffic 8% faster on an H200 for 89 more graphs, 106 MiB of GPU memory and 0.7 s of start-up "
        "(BERT-base; BENCHMARKS.md). Empty: the model's longest only")
    cuda_graph_lanes: int = Field(1, ge=1, le=4, description="CUDA, packed graphs: sessions that replay CUDA "
                                  "graphs side by side, each on its own thread with its own copy of the graph and "
                                  "of every captured bucket in GPU memory. Two replayed 30% more 40-text batches "
                                  "a second on an H100, a gain not seen through HTTP (BENCHMARKS.md)")
    cpu_cls_rows: bool = Field(True, description="CPU: run the batches that need no token vectors or mean "
                               "([CLS], pooled, NSP, a classifier) on the artifact's graph whose last layer runs at "
                               "the [CLS] position only, where export wrote one (python -m export --cpu-cls-rows; by "
                               "default for models of at most 6 layers). It holds the model's weights again in "
                               "memory; a [CLS] batch of the default 2-layer model took 34-39% less time "
                               "(BENCHMARKS.md). false: every batch on the one graph")
    cuda_graph_rows: int = Field(16, ge=1, le=256, description="CUDA, padded graphs: the largest batch (texts) "
                                 "replayed from a CUDA graph; one is captured for each power of two below it and "
                                 "for it, at each length bucket (a batch of mixed lengths may be replayed as a few "
                                 "buckets). More rows: more GPU memory (BERT-base on an H100: 2,065 MiB in all "
                                 "with 16 rows, 2,385 MiB with 32); above about 32 short texts the packed graph "
                                 "is faster (BENCHMARKS.md)")
    workers: int = Field(1, ge=1, le=64, description="HTTP worker processes (not inference_workers), handed the "
                         "port's connections in turn. Above 1 they parse, tokenise and answer around one engine "
                         "process that holds the session and the batcher (app/multiprocess/), metrics summed over "
                         "all: on a GPU one Python process cannot keep it busy (see BENCHMARKS.md); on the CPU "
                         "keep 1: inference_workers already use every core")
    engine_cores: int = Field(0, ge=0, le=64, description="CUDA with workers > 1: CPU cores kept for each engine "
                              "process (its event loop, the thread that replays CUDA graphs), the HTTP workers "
                              "running on the others this process may use; 0: no cores kept. 3 on a 16-core H200 "
                              "host with 12 workers: within the runs' spread of 0 at 1, 16 and 64 texts a request "
                              "(BENCHMARKS.md); for a host that is the server's alone")
    intra_op_threads: int | None = Field(None, ge=1, description="ONNX Runtime threads per batch. Default: one "
                                         "on the CPU (batches run side by side, one per core: faster than one "
                                         "batch over all cores), ONNX Runtime's own choice on CUDA")
    inference_workers: int | None = Field(None, ge=1, le=256, description="batches run at the same time on the "
                                          "one ONNX Runtime session, each in its own thread of the process that holds "
                                          "it (not HTTP processes: see workers). Default: one per usable core on the "
                                          "CPU, 2 on CUDA (while one batch is copied and collated the other runs; "
                                          "BENCHMARKS.md)")
    max_batch_tokens: int | None = Field(None, ge=1, description="token budget of a batch, counted padded: "
                                         "batch size x its longest sequence; the real limit on a batch, since the "
                                         "engine's time and memory follow padded tokens. Default: 16384 on CUDA "
                                         "(BERT-base activations stay small, batches of short texts still fill "
                                         "max_batch_size); 512 on the CPU, where every padded token costs and small "
                                         "batches of similar lengths run fastest (BENCHMARKS.md)")

    max_padding: float | None = Field(None, ge=0, le=1, description="padded graphs only (CPU; CUDA with "
                                      "`export --keep-padding`): a batch stops growing once more than this "
                                      "fraction of its padded tokens would be padding. Default: 0.1 on the CPU, "
                                      "where padding costs compute and small batches lose little; no limit on CUDA")
    max_batch_size: int = Field(256, ge=1, description="most sequences in one batch: a cap that only batches of "
                                "short texts reach (max_batch_tokens limits the others); set too low, GPU batches "
                                "stop at it while more work waits")
    max_wait_ms: float = Field(0.0, ge=0, le=1000, description="how long an idle batcher waits for more work "
                               "before running a batch that is not full (work that queued behind a running "
                               "batch never waits); 0: a lone request runs at once")
    overlap_min_tokens: int | None = Field(None, ge=1, description="with several inference_workers: a batch "
                                           "starts beside a running one only once this many tokens are queued, else "
                                           "the work waits for the running batch and joins the next, larger one "
                                           "(on a GPU small batches side by side run fewer texts a second). Empty: "
                                           "queued work starts in any free slot at once, but work that would "
                                           "replay a CUDA graph waits for a free replaying session")
    max_queued_sequences: int = Field(4096, ge=1, description="queue limit: beyond it requests get 429")
    max_queue_ms: float | None = Field(2000.0, gt=0, description="a request is admitted only while the queued "
                                       "work would start within this (estimated from the engine's measured speed, "
                                       "from a batch timed at start until the first batch finishes), "
                                       "else 429 at once with Retry-After from the backlog; so clients are answered "
                                       "within about this plus their own inference time. Empty: no limit")
    max_concurrent_requests: int = Field(512, ge=1, description="requests being served at once; beyond: 429")
    max_inputs_per_request: int = Field(2048, ge=1, description="most texts or pairs in one request (OpenAI's "
                                        "limit: LangChain's OpenAIEmbeddings sends 1,000); beyond: 413")
    max_input_chars: int = Field(2_000_000, ge=1, description="longest text accepted, even with truncation")
    max_token_vectors: int = Field(16_384, ge=1, description="most token vectors one request may ask for "
                                   "(/embed return_tokens, /tei/embed_all), counted in tokens: each is hidden_size "
                                   "floats of the answer (BERT-base: about 9 KB of JSON), held in memory until sent "
                                   "(TEI's own default, 32 inputs of 512 tokens); beyond: 413")
    max_request_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="largest request body; beyond: 413")
    max_header_bytes: int = Field(32 * 1024, ge=1024, le=1024 * 1024, description="largest request line + "
                                  "headers of one request; beyond: 431 and the connection is closed")
    header_timeout_s: float = Field(10.0, gt=0, description="time a client has to send a request line and "
                                    "headers (from connecting, or from the request's first byte on a kept-alive "
                                    "connection); beyond: 408 and the connection is closed")
    body_timeout_s: float = Field(30.0, gt=0, description="time a client has to send a body once its headers "
                                  "arrived; beyond: 408 and the connection is closed. Also how long a client may "
                                  "read none of an answer the kernel cannot hold: then the connection is dropped")
    keep_alive_s: float = Field(5.0, gt=0, description="an idle kept-alive connection is closed after this")
    drain_seconds: float = Field(5.0, ge=0, description="on SIGTERM / SIGINT: stop accepting, answer new "
                                 "requests 503, finish queued work for up to this long, answer what is left 503 "
                                 "(with Retry-After), exit 0. A supervisor's grace period must be longer by a few "
                                 "seconds (Docker's default is 10 s; Kubernetes: terminationGracePeriodSeconds > "
                                 "preStop sleep + this + 5)")
    api_key: SecretStr | None = Field(None, description="when set (whitespace around it dropped, as a key file's "
                                                        "newline; a key of only whitespace is refused), every "
                                                        "route needs `Authorization: Bearer KEY` but the page (`GET /` and `/static/`), `/health`, `/ping`, "
                                                        "`/ready`, `/metrics` and the docs (`/docs`, `/redoc`, "
                                                        "`/openapi.json`)")
    cors_allow_origins: str | None = Field(None, description="origins whose web pages may call the API from a browser, "
                                           "comma-separated (https://app.example.com,http://localhost:3000), or *: "
                                           "answers CORS preflights and adds Access-Control-Allow-Origin. Unset: no "
                                           "CORS headers, so browsers allow only pages served by this server")
    model_name: str | None = Field(None, description="name answered as `model`; default: the manifest's")
    openai_pooling: Literal[POOLINGS] | None = Field(None, description="pooling of /v1/embeddings (see /embed's "
                                                     "`pooling`); default: the model's (GET /info `default_pooling`)")
    openai_normalize: bool | None = Field(None, description="L2-normalise /v1/embeddings vectors (OpenAI's are); "
                                          "default: the model's (GET /info `default_normalize`)")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="critical, error, warning, info or debug")
    access_log: bool = Field(False, description="uvicorn's per-request log line (costs CPU under load)")

    @field_validator("api_key", "model_name", "max_queue_ms", "cuda_device_ids", "cuda_graph_short_lengths",
                     "cuda_graph_tokens",
                     "cors_allow_origins", "intra_op_threads", "inference_workers", "max_batch_tokens", "max_padding",
                     "overlap_min_tokens", "openai_pooling", "openai_normalize", mode="before")
    @classmethod
    def _empty_is_unset(cls, v):
        """Empty is unset, for every setting that may be: compose passes an unset ${X} as empty, and so may Helm."""
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("api_key", mode="before")
    @classmethod
    def _key_without_edge_whitespace(cls, v):
        """A key read from a file (a Kubernetes Secret made --from-file) often ends in a newline, which no
        client can send in a header: the key is what lies between. One that is only whitespace (a blank
        Secret) is refused rather than read as no key, which would serve without authentication."""
        if isinstance(v, str) and v and not v.strip():
            raise ValueError("the key is only whitespace (a blank key file?); give the key, or leave it unset "
                             "to serve without one")
        return v.strip() if isinstance(v, str) else v

    @field_validator("cors_allow_origins")
    @classmethod
    def _origins(cls, v: str | None) -> str | None:
        if v is not None and v != "*" and not all(re.fullmatch(r"https?://[^,\s/]+", o) for o in v.split(",")):
            raise ValueError(f"{v!r}: give origins as scheme://host[:port] without a path, comma-separated "
                             f"(https://app.example.com,http://localhost:3000), or * alone")
        return v

    @field_validator("port", mode="before")
    @classmethod
    def _not_a_service_link(cls, v):
        """Kubernetes sets BERTSERVE_PORT=tcp://IP:PORT in every pod of a namespace with a Service named
        bertserve (a service link), over the image's BERTSERVE_PORT: say so, not only that it is no number."""
        if isinstance(v, str) and v.startswith(("tcp://", "udp://", "sctp://")):
            raise ValueError(f"{v!r} is the address Kubernetes gives pods for a Service named bertserve (a service "
                             "link), not a port: set `enableServiceLinks: false` in the pod spec, or "
                             "BERTSERVE_PORT in the container's env")
        return v

    @field_validator("model_dir")
    @classmethod
    def _folder_exists(cls, v: Path) -> Path:
        if not v.is_dir():
            raise ValueError(f"{v} is not a folder; point it at an artifact folder made by `python -m export`")
        return v

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, v):
        return v.lower() if isinstance(v, str) else v

    @model_validator(mode="after")
    def _consistent(self) -> "Settings":
        if self.device == "cpu" and self.precision == "fp16":
            raise ValueError("precision fp16 needs device cuda (or auto): the fp16 graph is built for CUDA")
        if self.device == "cuda" and self.precision == "int8":
            raise ValueError("precision int8 runs on the CPU only: use device cpu (or auto)")
        if len(self.engine_devices) > 1 and self.workers < len(self.engine_devices):
            raise ValueError(f"cuda_device_ids names {len(self.engine_devices)} GPUs: workers must be at least that "
                             f"many (HTTP workers are shared out among the GPUs' engine processes)")
        if self.device == "cpu" and self.cuda_device_ids:
            raise ValueError("cuda_device_ids needs device cuda (or auto)")
        if self.engine_cores and (self.workers < 2 or self.device == "cpu"):
            raise ValueError("engine_cores needs workers > 1 and device cuda (or auto): it keeps cores for the "
                             "engine processes from the HTTP workers")
        return self

    @property
    def replay_short_lengths(self) -> tuple[int, ...]:
        """cuda_graph_short_lengths as numbers (none when unset)."""
        return tuple(_numbers(self.cuda_graph_short_lengths))

    @property
    def cors_origins(self) -> list[str]:
        """cors_allow_origins as a list (none when unset)."""
        return self.cors_allow_origins.split(",") if self.cors_allow_origins else []

    @property
    def engine_devices(self) -> list[int]:
        """The GPUs that get an engine process each (cuda_device_ids, else cuda_device_id)."""
        return _numbers(self.cuda_device_ids) or [self.cuda_device_id]


def shown_default(value: object) -> str:
    """A setting's default as `python -m app --help` and the README's settings table show it (a switch as
    its flag takes it: true / false)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


# BERTSERVE_* variables that are not settings: read by the operator library (custom_kernels/), or set by the
# server for its own processes.
OTHER_VARIABLES = frozenset(ENV_PREFIX + name for name in (
    "KERNELS_LIBRARY", "KERNELS_AUTOTUNE", "KERNELS_AUTOTUNE_LOG", "KERNELS_WORKSPACE_MB", "ENGINE_SOCKET"))
# Kubernetes' service links for a Service named bertserve (BERTSERVE_SERVICE_HOST, BERTSERVE_PORT_80_TCP, ...)
_SERVICE_LINK = re.compile(ENV_PREFIX + r"(SERVICE_\w+|PORT_\d+_\w+)")


def unknown_variables(environ: dict[str, str]) -> list[tuple[str, str | None]]:
    """The BERTSERVE_* variables that name no setting (pydantic-settings ignores them: a misspelt one would
    go unnoticed), each with the setting's variable it is closest to, if any."""
    import difflib

    settings = [name.upper() for name in Settings.model_fields]
    unknown = sorted(name for name in environ if name.startswith(ENV_PREFIX) and name[len(ENV_PREFIX):] not in settings
                     and name not in OTHER_VARIABLES and not _SERVICE_LINK.fullmatch(name))
    closest = [difflib.get_close_matches(name[len(ENV_PREFIX):], settings, n=1, cutoff=0.75) for name in unknown]
    return [(name, ENV_PREFIX + close[0] if close else None) for name, close in zip(unknown, closest)]


class _UvicornNamed(logging.Filter):
    """uvicorn logs its start, stop and errors alike as `uvicorn.error`: named `uvicorn` here, so that an
    INFO line does not read as an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn.error":
            record.name = "uvicorn"
        return True


def configure_logging(settings: Settings) -> None:
    """The log format and level of every server process (the launcher, HTTP workers, the engine), uvicorn's
    lines included (app/uvicorn_server.py leaves them to this root logger)."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _UvicornNamed) for f in handler.filters):
            handler.addFilter(_UvicornNamed())


def _numbers(text: str | None) -> list[int]:
    """A setting of comma-separated numbers (cuda_device_ids, cuda_graph_short_lengths) as them; none when unset."""
    return [int(n) for n in text.split(",")] if text else []
