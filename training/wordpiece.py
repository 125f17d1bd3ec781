"""The WordPiece tokenizer: train one on a corpus, or build one from an existing vocab.txt, and save
it in the files both our code and `transformers` read (tokenizer.json, vocab.txt, tokenizer_config.json).

Encoding a pair gives `[CLS] A [SEP] B [SEP]` with segment ids 0…0 1…1 through the post-processor,
so every consumer (training, export, server) gets the same ids from `tokenizer.encode(a, b)`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP, MASK)  # ids 0..4 in a vocabulary we train


def _pipeline(model: models.WordPiece, lowercase: bool, strip_accents: bool | None = None,
              handle_chinese_chars: bool = True) -> Tokenizer:
    tok = Tokenizer(model)
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=handle_chinese_chars, strip_accents=strip_accents, lowercase=lowercase
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok


def _add_pair_template(tok: Tokenizer) -> Tokenizer:
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"vocabulary lacks the special tokens {missing}")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{CLS} $A {SEP}",
        pair=f"{CLS} $A {SEP} $B:1 {SEP}:1",
        special_tokens=[(CLS, ids[CLS]), (SEP, ids[SEP])],
    )
    return tok


def train_wordpiece(texts: Sequence[str] | Callable[[], Iterable[str]], vocab_size: int, lowercase: bool = True,
                    min_frequency: int = 2) -> Tokenizer:
    """A WordPiece vocabulary of `vocab_size` trained on `texts` (a list, or a function that reads the corpus
    afresh each call: it is read twice), the same one every time.

    The tokenizers library's trainer is not deterministic (huggingface/tokenizers#1794): it numbers the
    word-continuing pieces ("##e") as it meets them in a hash map's order, which changes from one process to
    the next, and breaks ties between equally frequent merges by those numbers, so the same corpus gave
    another vocabulary on every run (106 of the default model's 4,096 pieces, and its figures with them).
    So a first training finds which continuing pieces there are, and the second, whose vocabulary is kept,
    is given them up front in sorted order, as the library numbers the alphabet."""
    if vocab_size < len(SPECIAL_TOKENS) + 100:
        raise ValueError(f"vocab_size {vocab_size} is too small; use at least {len(SPECIAL_TOKENS) + 100}")
    read = (lambda: texts) if isinstance(texts, Sequence) else texts
    first = _trained(read(), vocab_size, lowercase, min_frequency, SPECIAL_TOKENS)
    pieces = sorted(t for t in first.get_vocab() if t.startswith(_CONTINUING) and len(t) == len(_CONTINUING) + 1)
    tok = _trained(read(), vocab_size, lowercase, min_frequency, (*SPECIAL_TOKENS, *pieces))
    # The pieces were given as special tokens only to be numbered first: as such they would also be matched
    # whole in texts ("##e" typed in one). They stay in the vocabulary; only BERT's own tokens stay special.
    config = json.loads(tok.to_str())
    config["added_tokens"] = [t for t in config["added_tokens"] if t["content"] in SPECIAL_TOKENS]
    return _add_pair_template(Tokenizer.from_str(json.dumps(config)))


_CONTINUING = "##"


def _trained(texts: Iterable[str], vocab_size: int, lowercase: bool, min_frequency: int,
             special_tokens: Sequence[str]) -> Tokenizer:
    tok = _pipeline(models.WordPiece(unk_token=UNK, max_input_chars_per_word=100), lowercase)
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(special_tokens),
        # the caller follows the corpus as it is read, in a bar of its own (training.data)
        continuing_subword_prefix=_CONTINUING, show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def tokenizer_from_vocab(vocab_file: Path | str, lowercase: bool = True, *, each_once: bool = False,
                         strip_accents: bool | None = None, handle_chinese_chars: bool = True) -> Tokenizer:
    """A BERT tokenizer over an existing vocab.txt (one token per line, id = line number). `each_once`
    refuses a token on two lines, for a vocabulary a new model is sized by: the later line's id wins, as
    in transformers, which leaves the earlier id unused and one more id than there are tokens."""
    vocab_file = Path(vocab_file)
    if not vocab_file.is_file():
        raise ValueError(f"vocab file {vocab_file} does not exist")
    try:
        lines = vocab_file.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        line = vocab_file.read_bytes()[:e.start].count(b"\n") + 1
        raise ValueError(f"vocab file {vocab_file} is not UTF-8 text (line {line}); convert it to UTF-8") from e
    model = models.WordPiece.from_file(str(vocab_file), unk_token=UNK, max_input_chars_per_word=100)
    tok = _pipeline(model, lowercase, strip_accents, handle_chinese_chars)
    # "[SEP]" typed in a text is the special token, as transformers reads a vocab.txt (and as a tokenizer
    # trained here has it), not "[", "sep", "]": registered as special tokens, at their own ids
    vocab = tok.get_vocab()
    tok.add_special_tokens([t for t in SPECIAL_TOKENS if t in vocab])
    if each_once:
        used = set(tok.get_vocab().values())
        if (unused := next((i for i in range(len(lines)) if i not in used), None)) is not None:
            raise ValueError(f"vocab file {vocab_file}: line {unused + 1} ({lines[unused]!r}) appears again on a "
                             f"later line; each token must be on one line only (its line number is its id)")
    return _add_pair_template(tok)


def is_lowercase(tok: Tokenizer) -> bool:
    return bool((json.loads(tok.to_str())["normalizer"] or {}).get("lowercase", False))


def fingerprint(tok: Tokenizer) -> str:
    """What decides the ids a tokenizer gives (its tokens in id order and its lower-casing), hashed: equal
    for the same vocabulary however it was loaded or serialised."""
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    return hashlib.sha256(json.dumps([is_lowercase(tok), tokens]).encode()).hexdigest()


def save_tokenizer(tok: Tokenizer, out_dir: Path | str, model_max_length: int = 512) -> None:
    """tokenizer.json for us, vocab.txt + configs so `transformers.BertTokenizerFast` loads it too."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        tok.save(str(out_dir / "tokenizer.json"))
    except Exception as e:  # tokenizers raises a bare Exception: "No space left on device (os error 28)"
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(out_dir / "tokenizer.json")) from e
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    (out_dir / "vocab.txt").write_text("".join(f"{t}\n" for t, _ in vocab), encoding="utf-8")
    specials = {"pad_token": PAD, "unk_token": UNK, "cls_token": CLS, "sep_token": SEP, "mask_token": MASK}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    config = {"tokenizer_class": "BertTokenizer", "do_lower_case": is_lowercase(tok), **_normalizer_settings(tok),
              "model_max_length": model_max_length, **specials}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _normalizer_settings(tok: Tokenizer) -> dict:
    """A BertNormalizer's accent stripping and CJK splitting in tokenizer_config.json's words: transformers
    builds a BertTokenizer's normaliser from these, not from tokenizer.json, and would otherwise take its
    defaults (accents stripped when lower-casing, CJK characters split) whatever the tokenizer does."""
    normalizer = json.loads(tok.to_str())["normalizer"]
    if normalizer is None:  # no normaliser at all: neither, where transformers would take both
        return {"strip_accents": False, "tokenize_chinese_chars": False}
    if normalizer.get("type") != "BertNormalizer":
        return {}
    return {"strip_accents": normalizer.get("strip_accents"),
            "tokenize_chinese_chars": normalizer.get("handle_chinese_chars", True)}


# How transformers' BertTokenizer builds its normaliser: from tokenizer_config.json's key, else its default,
# never from tokenizer.json's setting. (key, BertNormalizer's setting, default)
TRANSFORMERS_NORMALIZER_KEYS = (("do_lower_case", "lowercase", True), ("strip_accents", "strip_accents", None),
                                ("tokenize_chinese_chars", "handle_chinese_chars", True))


def transformers_normalizer(config: dict) -> dict:
    """The BertNormalizer settings that transformers' BertTokenizer takes from tokenizer_config.json `config`
    (strip_accents None: as lower-casing), by BertNormalizer's names."""
    return {name: config.get(key, default) for key, name, default in TRANSFORMERS_NORMALIZER_KEYS}


def load_tokenizer_from_folder(folder: Path | str) -> Tokenizer:
    """tokenizer.json if present, else vocab.txt (+ do_lower_case from tokenizer_config.json).
    A tokenizer.json from elsewhere gets our pair template only if it has none."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        return tok if tok.post_processor is not None else _add_pair_template(tok)
    if (folder / "vocab.txt").is_file():
        config = {}
        cfg = folder / "tokenizer_config.json"
        if cfg.is_file():
            config = json.loads(cfg.read_text())
        if added := _added_tokens(folder, config):
            raise ValueError(f"{folder}: transformers also matches the added tokens {', '.join(added[:3])}"
                             f"{' ...' if len(added) > 3 else ''} (added_tokens.json, special_tokens_map.json or "
                             f"tokenizer_config.json) in texts, which a tokenizer made from vocab.txt does not; "
                             f"save the tokenizer with transformers' save_pretrained (it writes tokenizer.json) "
                             f"and use that folder")
        settings = transformers_normalizer(config)
        strip_accents = settings["strip_accents"]
        return tokenizer_from_vocab(folder / "vocab.txt", bool(settings["lowercase"]),
                                    strip_accents=None if strip_accents is None else bool(strip_accents),
                                    handle_chinese_chars=bool(settings["handle_chinese_chars"]))
    raise ValueError(f"{folder} has neither tokenizer.json nor vocab.txt")


def _added_tokens(folder: Path, config: dict) -> list[str]:
    """The tokens besides BERT's special ones that transformers adds to a vocab.txt folder's vocabulary, to
    be matched whole in texts: added_tokens.json's, the additional special tokens, and tokenizer_config.json's
    added_tokens_decoder."""
    found = []
    if (folder / "added_tokens.json").is_file():
        found += json.loads((folder / "added_tokens.json").read_text())
    special = folder / "special_tokens_map.json"
    for settings in (config, json.loads(special.read_text()) if special.is_file() else {}):
        for key in ("additional_special_tokens", "extra_special_tokens"):
            found += settings.get(key) or ()
    found += (config.get("added_tokens_decoder") or {}).values()
    names = (t.get("content") if isinstance(t, dict) else t for t in found)
    return list(dict.fromkeys(t for t in names if t not in SPECIAL_TOKENS))
