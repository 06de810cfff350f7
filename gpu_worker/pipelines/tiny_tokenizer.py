"""A small, hand-made CLIP-style BPE vocabulary (vocab.json + merges.txt) for the tiny pipelines.

Real tokenizers are downloaded; these files are generated here so the tiny pipelines need no
network. The merges are real BPE merges built from the words of `WORDS` (so common words become
one or a few tokens); any other text falls back to single characters.
"""

from __future__ import annotations

import json
from pathlib import Path

START_TOKEN = "<|startoftext|>"
END_TOKEN = "<|endoftext|>"
END_OF_WORD = "</w>"
MAX_LENGTH = 32

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-:;()&/"
_WORD_LIST = """
a an the of on in at with and to is photo picture painting drawing portrait landscape
cat dog bird fox horse fish tree flower forest mountain river sea sky sun moon city street
house car boat red green blue yellow black white orange purple small big old young bright
dark night day morning sunset snow rain cloud astronaut robot castle lighthouse beach
"""
WORDS = tuple(_WORD_LIST.split())


def tiny_vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    """The vocabulary (token -> id) and the ordered merge list; deterministic."""
    tokens: list[str] = []
    for char in ALPHABET:
        tokens += [char, char + END_OF_WORD]
    merges: list[str] = []
    for word in WORDS:
        symbols = [*word[:-1], word[-1] + END_OF_WORD]
        merged = symbols[0]
        for symbol in symbols[1:]:
            merge = f"{merged} {symbol}"
            merged += symbol
            if merge not in merges:
                merges.append(merge)
                tokens.append(merged)
    tokens += [START_TOKEN, END_TOKEN]
    unique = list(dict.fromkeys(tokens))
    return {token: index for index, token in enumerate(unique)}, merges


def write_tiny_vocab(folder: Path) -> tuple[Path, Path]:
    """Write vocab.json and merges.txt into `folder`; return their paths."""
    vocab, merges = tiny_vocab_and_merges()
    folder.mkdir(parents=True, exist_ok=True)
    vocab_path = folder / "vocab.json"
    merges_path = folder / "merges.txt"
    vocab_path.write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges_path.write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    return vocab_path, merges_path
