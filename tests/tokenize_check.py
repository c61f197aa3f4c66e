"""Checks loom-tokenize's shards, for loom_tokenize_shards: python tokenize_check.py TOKENIZER OUT_DIR FILES...
The shards read back as llm.c's loader reads them (magic, version 1, count, uint16 tokens); the validation shard
holds the first document, the training shard the others, each after the document separator, with the ids Hugging
Face tokenizers gives each file."""
import glob
import sys

import numpy as np
from tokenizers import Tokenizer


def read(path):
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(256 * 4), dtype=np.int32)
        assert header[0] == 20240520 and header[1] == 1, (path, header[:3])
        tokens = np.frombuffer(f.read(), dtype=np.uint16)
    assert len(tokens) == header[2], (path, len(tokens), header[2])
    return tokens.tolist()


tok = Tokenizer.from_file(sys.argv[1])
sep = tok.token_to_id("<|endoftext|>")
docs = [[sep] + tok.encode(open(f, encoding="utf-8").read(), add_special_tokens=False).ids for f in sys.argv[3:]]
val = sorted(glob.glob(f"{sys.argv[2]}/val_*.bin"))
train = sorted(glob.glob(f"{sys.argv[2]}/train_*.bin"))
assert len(val) >= 1 and len(train) >= 2, (val, train)  # --shard-tokens splits the training tokens
assert sum((read(v) for v in val), []) == docs[0], "the validation shards are not the first document"
assert sum((read(t) for t in train), []) == sum(docs[1:], []), "the training shards are not the other documents"
print("loom-tokenize's shards hold tokenizers' ids, as llm.c reads them")
