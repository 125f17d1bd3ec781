"""Request and response bodies of every endpoint (the OpenAPI schema at /docs is made from these)."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from artifact.manifest import POOLINGS

# minLength / minItems are stated in the OpenAPI schema only: the service refuses empty inputs itself, with
# a message that names the input (app/service.py, app/tokenization.py).
Text = Annotated[str, Field(json_schema_extra={"minLength": 1})]
Pair = Annotated[list[Text], Field(min_length=2, max_length=2, description="[text_a, text_b]")]
Inputs = Text | Annotated[list[Text | Pair], Field(json_schema_extra={"minItems": 1})]
Pooling = Literal[(*POOLINGS, "none")]
EncodingFormat = Literal["float", "base64"]
TruncationDirection = Literal["right", "left"]  # app.tokenization.DIRECTIONS
_DIRECTION_TEXT = ("which end of an over-long input truncation cuts: right keeps its start, left its end (after "
                   "the prompt, if any, which is kept whole); null: the model's (GET /info `truncation_direction`, "
                   "its tokenizer_config.json truncation_side as transformers reads it; right unless it says left)")
_PROMPT_TEXT = ("one of the model's prompts (GET /info `prompts`, e.g. query), put before each text as "
                "sentence-transformers does; null: the model's default prompt (`default_prompt_name`), if any; \"\": "
                "no prompt, not even the default (sentence-transformers' prompt=\"\")")


def _whole_float_as_int(value):
    """orjson reads an integer past 64 bits (10**30) as a float: taken as the integer it is, it gets the range's
    message (InferenceService.check_dimensions) rather than "should be a valid integer"."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# The range, 1 to the width of the vectors asked for, is checked by the service, which knows that width.
Dimensions = Annotated[int, BeforeValidator(_whole_float_as_int), Field(json_schema_extra={"minimum": 1})]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def as_items(inputs: str | list) -> list:
    """Request inputs -> list of str | (text_a, text_b)."""
    if isinstance(inputs, str):
        return [inputs]
    return [x if isinstance(x, str) else (x[0], x[1]) for x in inputs]


class EmbedRequest(_Strict):
    inputs: Inputs = Field(
        description="a text, or a list whose items are texts or sentence pairs [text_a, text_b] "
                    "(encoded [CLS] A [SEP] B [SEP] with segment ids 0 / 1)",
        examples=["The quick brown fox", ["first text", ["a question?", "its answer."]]])
    pooling: Pooling | None = Field(
        None, description="null: the model's default (GET /info `default_pooling`: a sentence-transformers "
        "checkpoint's own Pooling, else cls). cls: the raw [CLS] vector; pooled: BERT's pooler, "
        "tanh(dense([CLS])); over all real tokens, [CLS] and [SEP] included, as sentence-transformers "
        "computes them: mean, max (per dimension), mean_sqrt_len (sum / sqrt(tokens)), weightedmean (token i "
        "from 1 weighs i), lasttoken (the final [SEP]); none: no embedding")
    normalize: bool | None = Field(None, description="L2-normalise the embedding (not the token vectors); "
                                   "null: the model's default (GET /info `default_normalize`)")
    truncate: bool = Field(True, description="cut inputs to the model's max length; false: an over-long "
                           "input is answered 413")
    truncation_direction: TruncationDirection | None = Field(None, description=_DIRECTION_TEXT)
    prompt_name: str | None = Field(None, description=_PROMPT_TEXT)
    return_tokens: bool = Field(False, description="add each input's tokens and their vectors")
    encoding_format: EncodingFormat = Field("float", description="base64: little-endian float32 bytes; "
                                            "token_embeddings as one [n_tokens, hidden] row-major block")


class TokenizeRequest(_Strict):
    inputs: Inputs
    truncate: bool = True
    truncation_direction: TruncationDirection | None = Field(None, description=_DIRECTION_TEXT)
    prompt_name: str | None = Field(None, description=_PROMPT_TEXT)


class NspRequest(_Strict):
    pairs: list[Pair] = Field(description="[[text_a, text_b], ...]: does B follow A?",
                              json_schema_extra={"minItems": 1})
    truncate: bool = True


class OpenAIEmbeddingRequest(BaseModel):
    """OpenAI's /v1/embeddings body; unknown fields (e.g. `user`) are ignored as OpenAI does."""
    model_config = ConfigDict(extra="ignore", strict=True)
    input: Text | Annotated[list[Text], Field(json_schema_extra={"minItems": 1})] | list[int] | list[list[int]]
    model: str | None = Field(None, description="accepted and ignored: the server has one model")
    encoding_format: EncodingFormat | None = Field("float", description="null: float, as OpenAI takes it")
    dimensions: Dimensions | None = Field(
        None, description="keep the first that many of the model's width (GET /info `dimensions`), normalised "
                          "after if the vectors are: for Matryoshka-trained models")


class _TeiRequest(BaseModel):
    """A body as text-embeddings-inference takes it: fields TEI ignores are ignored here too, `truncate` may
    be null and the direction capitalised."""
    model_config = ConfigDict(extra="ignore", strict=True)
    truncate: bool | None = Field(None, description="cut inputs to the model's max length, a pair's longer text "
                                  "first (null: true); false: an over-long input is answered 413")
    truncation_direction: Literal["right", "left", "Right", "Left"] | None = Field(None, description=_DIRECTION_TEXT)

    @property
    def truncates(self) -> bool:
        return self.truncate is not False

    @property
    def direction(self) -> str | None:
        """app.tokenization.DIRECTIONS; None: the model's"""
        return self.truncation_direction and self.truncation_direction.lower()


class TeiEmbedAllRequest(_TeiRequest):
    """text-embeddings-inference's /embed_all body; its /embed body adds to it."""
    inputs: Text | Annotated[list[Text], Field(json_schema_extra={"minItems": 1})] = Field(
        description="a text or a list of texts", examples=["What is deep learning?"])
    prompt_name: str | None = Field(None, description=_PROMPT_TEXT)


class TeiEmbedRequest(TeiEmbedAllRequest):
    """POST / and /tei/embed as text-embeddings-inference's /embed takes it."""
    normalize: bool = Field(True, description="L2-normalise each embedding (TEI's default: true)")
    dimensions: Dimensions | None = Field(None, description="keep the first that many values of each embedding, "
                                          "normalised after if `normalize`: for Matryoshka-trained models")
    encoding_format: Literal["float"] | None = Field(None, description="float only: the answer is JSON numbers")


class SimilarityInput(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    source_sentence: Text = Field(examples=["What is deep learning?"])
    sentences: list[Text] = Field(
        min_length=1, description="compared with source_sentence, each in turn", examples=[["Deep learning is a kind of ML."]])


class SimilarityParameters(_TeiRequest):
    prompt_name: str | None = Field(None, description=_PROMPT_TEXT)


class TeiSimilarityRequest(BaseModel):
    """POST /similarity as text-embeddings-inference takes it (and POST / with such `inputs`, where
    huggingface_hub's InferenceClient.sentence_similarity sends it)."""
    model_config = ConfigDict(extra="ignore", strict=True)
    inputs: SimilarityInput
    parameters: SimilarityParameters | None = Field(None, description="truncate, truncation_direction, prompt_name")


_RAW_SCORES_TEXT = ("the head's logits instead of scores (a sigmoid for one label and for each label of a "
                    "multi-label classifier, a regression's logits, else a softmax)")


class RerankRequest(_TeiRequest):
    """POST /rerank as text-embeddings-inference takes it: a cross-encoder scores each (query, text) pair."""
    query: Text = Field(examples=["What is deep learning?"])
    texts: Annotated[list[Text], Field(json_schema_extra={"minItems": 1})] = Field(
        examples=[["Deep learning is a kind of machine learning.", "Paris is in France."]])
    raw_scores: bool = Field(False, description=_RAW_SCORES_TEXT)
    return_text: bool = Field(False, description="add each text to its rank")


class Rank(BaseModel):
    index: int = Field(description="the text's place in `texts`")
    score: float
    text: str | None = Field(None, description="with return_text")


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    text: Text


class DocumentsRerankRequest(BaseModel):
    """POST /v1/rerank and /v2/rerank (and /rerank with `documents`) as Cohere's and Jina's rerank APIs
    take them, and infinity and vLLM serve them. What a one-model server cannot honour (`rank_fields`,
    `max_chunks_per_doc`, `max_tokens_per_doc`, `priority`) is ignored: documents are cut to the model's
    max length."""
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = Field(None, description="accepted and ignored: the server has one model")
    query: Text = Field(examples=["What is deep learning?"])
    documents: Annotated[list[Text | RerankDocument], Field(json_schema_extra={"minItems": 1})] = Field(
        description="texts, or objects with a `text`", examples=[["Deep learning is a kind of ML.", "Paris."]])
    top_n: int | None = Field(None, ge=1, description="answer the most relevant that many (default: all)")
    return_documents: bool = Field(False, description="add each document as {\"text\"} to its result")
    raw_scores: bool = Field(False, description="infinity's: the logits as relevance_score, not their sigmoid")


class DocumentRank(BaseModel):
    index: int = Field(description="the document's place in `documents`")
    relevance_score: float = Field(description="a sigmoid of the cross-encoder's logit, in [0, 1]")
    document: RerankDocument | None = Field(None, description="with return_documents")


class DocumentsRerankResponse(BaseModel):
    object: Literal["rerank"]
    id: str
    created: int = Field(description="Unix time")
    model: str
    results: list[DocumentRank] = Field(description="most relevant first")
    usage: dict = Field(description="`prompt_tokens` and `total_tokens`: the tokens of every [query, document] pair")
    meta: dict = Field(description="Cohere's: `billed_units.search_units` 1")


PredictItem = Text | Annotated[list[Text], Field(min_length=1, max_length=2)]


class PredictRequest(_TeiRequest):
    """POST /predict as text-embeddings-inference takes it: a sequence classifier's labels and scores."""
    inputs: PredictItem | Annotated[list[Annotated[list[Text], Field(min_length=1, max_length=2)]],
                                    Field(json_schema_extra={"minItems": 1})] = Field(
        description="a text, a pair [text_a, text_b], or a batch of [text] and [text_a, text_b]",
        examples=["I like you.", [["I like you.", "I love you."], ["a single text"]]])
    raw_scores: bool = Field(False, description=_RAW_SCORES_TEXT)


class Prediction(BaseModel):
    score: float
    label: str


class Token(BaseModel):
    id: int
    token: str
    segment: int = Field(description="0: text_a, 1: text_b")
    start: int = Field(description="character offset in its own text (text_a or text_b); 0 for specials")
    end: int
    special: bool


class EmbeddingItem(BaseModel):
    index: int
    embedding: list[float] | str | None = Field(description="null for pooling none; str for base64")
    tokens: list[Token] | None = None
    token_embeddings: list[list[float]] | str | None = None


class Usage(BaseModel):
    tokens: int = Field(description="tokens processed, specials included")


class EmbedResponse(BaseModel):
    model: str
    data: list[EmbeddingItem]
    usage: Usage


class TokenizeItem(BaseModel):
    index: int
    tokens: list[Token]


class TokenizeResponse(BaseModel):
    model: str
    data: list[TokenizeItem]
    usage: Usage


class NspItem(BaseModel):
    index: int
    is_next: float = Field(description="softmax probability that text_b follows text_a")
    logits: list[float] = Field(description="[is_next, not_next]")


class NspResponse(BaseModel):
    model: str
    data: list[NspItem]
    usage: Usage


class OpenAIEmbedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class OpenAIUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIEmbedding]
    model: str
    usage: OpenAIUsage


class ErrorBody(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorBody


ERROR_RESPONSES = {code: {"model": ErrorResponse} for code in (401, 413, 415, 422, 429, 503)}
# ... and 400 (unsupported: well formed, but not for this model) on the service routes
SERVICE_ERROR_RESPONSES = {400: {"model": ErrorResponse}, **ERROR_RESPONSES}
