#!/usr/bin/python3
"""The GPT of include/loom/models/gpt.hpp written in PyTorch: the same parameters (Hugging Face GPT-2 names and
layout), the same forward. Two uses:

  reference: load DIR/model.safetensors and DIR/config.json (written by loom's save_gpt), compute the loss and the
             gradient for a batch given as JSON, print them as JSON (the oracle of tests/test_gpt_torch.cpp);
  bench:     time training steps (forward, backward, AdamW) of a shape on the CPU with a given thread count and
             print one JSON line: tokens_per_s, step_ms;
  bench-cuda: the same on the GPU, float32 weights under bf16 autocast (or plain float32), fused AdamW, eager or
             torch.compile'd, as PyTorch users train GPT-2.

Usage: gpt_torch.py reference DIR BATCH.json   |   gpt_torch.py bench LAYERS HEADS D VOCAB SEQ BATCH STEPS THREADS
       gpt_torch.py bench-cuda LAYERS HEADS D VOCAB SEQ BATCH STEPS bf16|f32 eager|compile
"""
import json
import math
import struct
import sys
import time

import numpy as np
import torch

DTYPES = {"F32": np.float32, "F64": np.float64}


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, v in header.items():
        if name == "__metadata__":
            continue
        b, e = v["data_offsets"]
        out[name] = np.frombuffer(data[b:e], dtype=DTYPES[v["dtype"]]).reshape(v["shape"]).copy()
    return out


class Gpt(torch.nn.Module):
    def __init__(self, layers, heads, kv_heads, d, vocab, max_seq, eps=1e-5, dtype=torch.float32):
        super().__init__()
        self.layers, self.heads, self.kv_heads, self.d, self.eps = layers, heads, kv_heads, d, eps
        hd = d // heads
        q = (heads + 2 * kv_heads) * hd
        p = {}

        def add(name, *shape, std=0.02, value=None):
            t = torch.empty(*shape, dtype=dtype)
            if value is None:
                torch.nn.init.normal_(t, std=std)
            else:
                t.fill_(value)
            p[name] = torch.nn.Parameter(t)

        add("wte.weight", vocab, d)
        add("wpe.weight", max_seq, d, std=0.01)
        for l in range(layers):
            h = f"h.{l}."
            add(h + "ln_1.weight", d, value=1.0)
            add(h + "ln_1.bias", d, value=0.0)
            add(h + "attn.c_attn.weight", d, q)
            add(h + "attn.c_attn.bias", q, value=0.0)
            add(h + "attn.c_proj.weight", d, d, std=0.02 / math.sqrt(2 * layers))
            add(h + "attn.c_proj.bias", d, value=0.0)
            add(h + "ln_2.weight", d, value=1.0)
            add(h + "ln_2.bias", d, value=0.0)
            add(h + "mlp.c_fc.weight", d, 4 * d)
            add(h + "mlp.c_fc.bias", 4 * d, value=0.0)
            add(h + "mlp.c_proj.weight", 4 * d, d, std=0.02 / math.sqrt(2 * layers))
            add(h + "mlp.c_proj.bias", d, value=0.0)
        add("ln_f.weight", d, value=1.0)
        add("ln_f.bias", d, value=0.0)
        self.p = torch.nn.ParameterDict({k.replace(".", "__"): v for k, v in p.items()})

    def w(self, name):
        return self.p[name.replace(".", "__")]

    def forward(self, ids, targets):
        B, T = ids.shape
        d, H, Hkv = self.d, self.heads, self.kv_heads
        hd = d // H
        x = self.w("wte.weight")[ids] + self.w("wpe.weight")[:T]
        for l in range(self.layers):
            h = f"h.{l}."
            a = torch.nn.functional.layer_norm(x, (d,), self.w(h + "ln_1.weight"), self.w(h + "ln_1.bias"), self.eps)
            qkv = a @ self.w(h + "attn.c_attn.weight") + self.w(h + "attn.c_attn.bias")
            q, k, v = qkv.split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
            q = q.view(B, T, H, hd).transpose(1, 2)
            k = k.view(B, T, Hkv, hd).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
            v = v.view(B, T, Hkv, hd).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True) \
                if hasattr(torch.nn.functional, "scaled_dot_product_attention") else self._attention(q, k, v)
            y = y.transpose(1, 2).reshape(B, T, d)
            x = x + y @ self.w(h + "attn.c_proj.weight") + self.w(h + "attn.c_proj.bias")
            a = torch.nn.functional.layer_norm(x, (d,), self.w(h + "ln_2.weight"), self.w(h + "ln_2.bias"), self.eps)
            f = torch.nn.functional.gelu(a @ self.w(h + "mlp.c_fc.weight") + self.w(h + "mlp.c_fc.bias"),
                                         approximate="tanh")
            x = x + f @ self.w(h + "mlp.c_proj.weight") + self.w(h + "mlp.c_proj.bias")
        x = torch.nn.functional.layer_norm(x, (d,), self.w("ln_f.weight"), self.w("ln_f.bias"), self.eps)
        logits = x @ self.w("wte.weight").t()
        return torch.nn.functional.cross_entropy(logits.view(B * T, -1), targets.view(-1))

    @staticmethod
    def _attention(q, k, v):
        T = q.shape[-2]
        s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        s = s.masked_fill(~mask, float("-inf"))
        return torch.softmax(s, dim=-1) @ v


def reference(directory, batch_file):
    cfg = json.load(open(f"{directory}/config.json"))
    tensors = read_safetensors(f"{directory}/model.safetensors")
    dtype = torch.float64 if next(iter(tensors.values())).dtype == np.float64 else torch.float32
    m = Gpt(cfg["n_layer"], cfg["n_head"], cfg.get("n_kv_head", cfg["n_head"]), cfg["n_embd"], cfg["vocab_size"],
            cfg["n_positions"], cfg["layer_norm_epsilon"], dtype)
    with torch.no_grad():
        for name, arr in tensors.items():
            m.w(name).copy_(torch.from_numpy(arr))
    b = json.load(open(batch_file))
    ids = torch.tensor(b["ids"]).view(b["B"], b["T"])
    targets = torch.tensor(b["targets"]).view(b["B"], b["T"])
    loss = m(ids, targets)
    loss.backward()
    grads = {name: m.w(name).grad.reshape(-1).tolist() for name in tensors}
    print(json.dumps({"loss": loss.item(), "grads": grads}))


def bench(layers, heads, d, vocab, seq, batch, steps, threads):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    m = Gpt(layers, heads, heads, d, vocab, seq)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    ids = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch, seq))
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = m(ids, targets)
        loss.backward()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    step = sorted(times)[len(times) // 2]
    print(json.dumps({"backend": "pytorch", "version": torch.__version__, "threads": threads,
                      "step_ms": step * 1e3, "tokens_per_s": batch * seq / step}))


def bench_cuda(layers, heads, d, vocab, seq, batch, steps, dtype, mode):
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    m = Gpt(layers, heads, heads, d, vocab, seq).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    model = torch.compile(m) if mode == "compile" else m
    ids = torch.randint(0, vocab, (batch, seq), device="cuda")
    targets = torch.randint(0, vocab, (batch, seq), device="cuda")
    times = []
    for i in range(steps + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = model(ids, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    step = sorted(times)[len(times) // 2]
    print(json.dumps({"backend": "pytorch", "version": torch.__version__ + (" compile" if mode == "compile" else ""),
                      "step_ms": step * 1e3, "tokens_per_s": batch * seq / step,
                      "peak_bytes": torch.cuda.max_memory_allocated()}))


if __name__ == "__main__":
    if sys.argv[1] == "reference":
        reference(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "bench":
        bench(*[int(x) for x in sys.argv[2:10]])
    elif sys.argv[1] == "bench-cuda":
        bench_cuda(*[int(x) for x in sys.argv[2:9]], sys.argv[9], sys.argv[10])
    else:
        sys.exit(__doc__)
