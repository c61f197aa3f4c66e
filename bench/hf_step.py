"""A training step of a Hugging Face transformers model (LlamaForCausalLM, MixtralForCausalLM) on the CPU, for
bench/gpt_step's families: forward, backward and AdamW on random tokens with the given thread count; prints one JSON
line: version, threads, step_ms (the median of STEPS after two warm-up steps), tokens_per_s.

Usage: hf_step.py CONFIG.json SEQ BATCH STEPS THREADS   (config.json as loom's checkpoint::llama_config writes it)
"""
import json
import sys
import time

import torch
import transformers


def main(config_file, seq, batch, steps, threads):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    c = json.load(open(config_file))
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM)}[c["model_type"]]
    config = cls[0](**{k: v for k, v in c.items() if k not in ("model_type", "architectures", "torch_dtype")},
                    attn_implementation="eager")  # torch 1.13 has no SDPA for transformers
    model = cls[1](config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab = config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch, seq))
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    step = sorted(times)[len(times) // 2]
    print(json.dumps({"backend": "transformers", "version": transformers.__version__ + " (torch " +
                      torch.__version__ + ")", "threads": threads, "step_ms": step * 1e3,
                      "tokens_per_s": batch * seq / step}))


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:6]))
