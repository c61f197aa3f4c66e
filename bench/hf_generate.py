"""Greedy decoding with a Hugging Face transformers model and its key/value cache (past_key_values), for bench/data's
generate rows: a model of the configuration given (random weights, float32, eval mode), a prompt of P tokens, then N
tokens one at a time, each from the cache of the ones before; prints one JSON line: version, threads,
prefill_tokens_per_s (the prompt's forward), tokens_per_s (the tokens after the first).

Usage: hf_generate.py CONFIG.json P N THREADS   (config.json as loom's checkpoint::gpt_config writes it)
"""
import json
import sys
import time

import torch
import transformers


def main(config_file, prompt, new, threads):
    transformers.logging.set_verbosity_error()  # the legacy cache's deprecation notice
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    c = json.load(open(config_file))
    kind = c.pop("model_type")
    c = {k: v for k, v in c.items() if k not in ("architectures", "torch_dtype")}
    config = transformers.AutoConfig.for_model(kind, attn_implementation="eager", **c)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    ids = torch.tensor([[(i * 7919 + 13) % config.vocab_size for i in range(prompt)]])

    def decode(n):
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model(ids, use_cache=True)
            first = time.perf_counter()
            past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(n - 1):
                out = model(token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            return first - t0, time.perf_counter() - first

    decode(4)  # warm-up
    prefill, rest = decode(new)
    print(json.dumps({"version": transformers.__version__, "threads": threads, "prefill_tokens_per_s": prompt / prefill,
                      "tokens_per_s": (new - 1) / rest}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
