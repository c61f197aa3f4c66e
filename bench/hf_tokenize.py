"""Hugging Face tokenizers encoding documents, for bench/data's tokenize rows: encode_batch over the files' texts
(each file one document) on the threads RAYON_NUM_THREADS gives; prints one JSON line: version, bytes, seconds,
mb_per_s (the encoding alone, after reading the files; the best of three runs).

Usage: RAYON_NUM_THREADS=N hf_tokenize.py TOKENIZER.json FILE [FILE ...]
"""
import json
import sys
import time

import tokenizers


def main(tokenizer_file, files):
    tok = tokenizers.Tokenizer.from_file(tokenizer_file)
    texts = [open(f, encoding="utf-8").read() for f in files]
    size = sum(len(t.encode("utf-8")) for t in texts)
    best = None
    for _ in range(3):
        t0 = time.perf_counter()
        tok.encode_batch(texts, add_special_tokens=False)
        s = time.perf_counter() - t0
        best = s if best is None else min(best, s)
    print(json.dumps({"version": tokenizers.__version__, "bytes": size, "seconds": best, "mb_per_s": size / best / 1e6}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
