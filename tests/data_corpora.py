"""Synthetic corpora for the data tests: seeded, small, with words the tokenizer splits into ## pieces."""
from __future__ import annotations

import random
from pathlib import Path

WORDS = """the of and a to in is was he for it with as his on be at by this had not are but from or have
an they which one you were her all she there would their we him been has when who will more no if out so
said what up its about into than them can only other new some could time these two may then do first any
my now such like our over man me even most made after also did many before must through back years where
much your way well down should because each just those people how too little state good very make world
still own see men work long get here between both life being under never day same another know while last
might us great old year off come since against go came right used take three""".split()
_SYLLABLES = "zor blax quin tev mur dak sil vop rhe gan tul wix yar pem fos".split()


def sentence(rng: random.Random, low: int, high: int, made_up: float = 0.15) -> str:
    words = []
    for _ in range(rng.randint(low, high)):
        if rng.random() < made_up:  # a rare made-up word: several ## pieces
            words.append("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))))
        else:
            words.append(rng.choice(WORDS))
    return " ".join(words).capitalize() + "."


def write_txt_corpus(path: Path, n_docs: int, sentences: tuple[int, int], words: tuple[int, int],
                     seed: int = 0, made_up: float = 0.15) -> Path:
    """One sentence per line, documents separated by a blank line."""
    rng = random.Random(seed)
    docs = ["\n".join(sentence(rng, *words, made_up) for _ in range(rng.randint(*sentences)))
            for _ in range(n_docs)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def prepare(tmp: Path, corpus: Path, **config):
    from training.data import DataConfig, prepare_data
    cfg = DataConfig(corpus=(str(corpus),), cache_dir=str(tmp / "cache"), **{"vocab_size": 400, **config})
    return prepare_data(cfg, show_progress=False)


def document_of(shards, positions):
    """The document holding each global token position."""
    import numpy as np
    sentence = np.searchsorted(shards.sentence_starts, positions, side="right") - 1
    return np.searchsorted(shards.document_starts, sentence, side="right") - 1
