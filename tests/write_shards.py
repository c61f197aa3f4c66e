"""Writes token shards in llm.c's format for train_gpt's tests, with numpy as llm.c's own scripts write them, and
reads every one back as llm.c's loader reads it (the header's magic, version and count, then the uint16 tokens).

    python3 write_shards.py DIR
DIR/train_000000.bin, DIR/train_000001.bin and DIR/val_000000.bin: a deterministic text's bytes, each a token;
DIR/big_000000.bin: tokens up to 299, beyond a byte vocabulary.
"""
import sys

import numpy as np


def write(path, tokens):
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())


def read(path):
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(256 * 4), dtype=np.int32)
        assert header[0] == 20240520 and header[1] == 1, path
        tokens = np.frombuffer(f.read(), dtype=np.uint16)
    assert len(tokens) == header[2], path
    return tokens


words = ["the", "weaver", "pulls", "a", "long", "thread", "across", "old", "loom", "and", "river", "light"]
rng = np.random.default_rng(7)
text = " ".join(words[i] for i in rng.integers(0, len(words), 6000)).encode()
tokens = np.frombuffer(text, dtype=np.uint8).astype(np.uint16)
n = len(tokens)
parts = {"train_000000.bin": tokens[: n * 4 // 10], "train_000001.bin": tokens[n * 4 // 10 : n * 9 // 10],
         "val_000000.bin": tokens[n * 9 // 10 :], "big_000000.bin": np.arange(2000, dtype=np.uint16) % 300}
for name, t in parts.items():
    write(f"{sys.argv[1]}/{name}", t)
    assert np.array_equal(read(f"{sys.argv[1]}/{name}"), t)
