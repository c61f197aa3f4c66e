"""The ids Hugging Face `tokenizers` gives a text, for test_tokenizer: python tokenizer_reference.py TOKENIZER TEXT
OUT writes OUT as JSON {"ids": [...], "decoded": "..."} (encoded without the post-processor's special tokens)."""
import json
import sys

from tokenizers import Tokenizer

tok = Tokenizer.from_file(sys.argv[1])
text = open(sys.argv[2], encoding="utf-8").read()
ids = tok.encode(text, add_special_tokens=False).ids
json.dump({"ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)}, open(sys.argv[3], "w"))
