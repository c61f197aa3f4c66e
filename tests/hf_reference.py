"""Hugging Face transformers as the oracle of loom's model families (tests/test_hf_families.cpp).

  make FAMILY DIR [FAMILY DIR ...]:  a random small model of each FAMILY (llama, mixtral or gpt2) in double
                    precision, saved with save_pretrained to its DIR, and DIR/reference.json: for the batch of
                    DIR/batch.json (ids, targets, B, T) the logits, the loss, the gradient of every parameter (Hugging
                    Face names), and the parameters after 3 AdamW steps on that batch (the hyper-parameters in
                    batch.json); and greedy decoding from the untrained model: batch.json's prompt and new_tokens,
                    the tokens chosen and the logits each was chosen from (greedy, greedy_logits).
  logits DIR [DIR ...]:  loads each DIR with from_pretrained and writes the logits of DIR/batch.json's ids to
                    DIR/logits.json.
(One process for several models: importing torch and transformers is most of a call's time.)

transformers computes some things in float32 whatever the model's type: RMSNorm's statistics, the rotary tables
(inverse frequencies and angles), and the softmaxes it asks for in float32 (eager attention's, Mixtral's router's).
They are computed here in the model's type (double), with the same formulas, so that the comparison holds to double
precision; the patches are the functions below.
"""
import json
import math
import sys

import torch
import torch.nn.functional as F
import transformers
from transformers.models.gpt2 import modeling_gpt2
from transformers.models.llama import modeling_llama
from transformers.models.mixtral import modeling_mixtral


def rms_norm_forward(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def rope_inv_freq(config):
    """inv_freq of the config's RoPE (default, or Llama 3's scaling), in double."""
    dim = config.hidden_size // config.num_attention_heads
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rs = getattr(config, "rope_scaling", None)
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rotary_forward(self, x, position_ids):
    freqs = (self.inv_freq[None, :, None].to(torch.float64) @ position_ids[:, None, :].to(torch.float64)).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def patch():
    for m in (modeling_llama.LlamaRMSNorm, modeling_mixtral.MixtralRMSNorm):
        m.forward = rms_norm_forward
    modeling_llama.LlamaRotaryEmbedding.forward = rotary_forward
    # softmax(x, dtype=torch.float32) of a double x: in double.
    softmax = F.softmax

    def double_softmax(input, dim=None, _stacklevel=3, dtype=None):
        if dtype is not None and input.dtype == torch.float64:
            dtype = None
        return softmax(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)
    F.softmax = double_softmax


def set_rope(model, config):
    for mod in model.modules():
        if isinstance(mod, modeling_llama.LlamaRotaryEmbedding):
            mod.inv_freq = rope_inv_freq(config)
        if isinstance(mod, modeling_mixtral.MixtralRotaryEmbedding):  # its tables are made once, at construction
            mod.inv_freq = rope_inv_freq(config)
            mod._set_cos_sin_cache(seq_len=config.max_position_embeddings, device="cpu", dtype=torch.float64)


def config_of(family, b):
    common = dict(vocab_size=b["vocab"], hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager")
    if family == "llama":
        return transformers.LlamaConfig(intermediate_size=24, rope_theta=500000.0, rms_norm_eps=1e-5,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 8},
                                        tie_word_embeddings=False, **common)
    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                          rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                          router_aux_loss_coef=0.0, **common)
    return transformers.GPT2Config(vocab_size=b["vocab"], n_embd=16, n_layer=2, n_head=4, n_positions=32,
                                   activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0, attn_implementation="eager")


def loss_of(model, ids, targets):
    logits = model(ids).logits
    return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def greedy_of(model, prompt, n):
    """Greedy decoding as a loop over the model's forward (transformers' generate() fails to import with Debian's
    torch 1.13): each step runs the whole text so far and takes the argmax of the last position's logits (the lowest
    id among equals). Returns the tokens and the logits each was chosen from."""
    ids, chosen_from = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            last = model(torch.tensor([ids])).logits[0, -1]
            chosen_from.append(last.tolist())
            ids.append(int(torch.argmax(last)))
    return {"greedy": ids[len(prompt):], "greedy_logits": chosen_from}


def make(family, d):
    b = json.load(open(f"{d}/batch.json"))
    torch.manual_seed(b.get("seed", 0))
    config = config_of(family, b)
    cls = {"llama": transformers.LlamaForCausalLM, "mixtral": transformers.MixtralForCausalLM,
           "gpt2": transformers.GPT2LMHeadModel}[family]
    model = cls(config).double()
    if family == "gpt2":  # random biases and norms too, so that their gradients are checked against nonzero values
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.dim() == 1:
                    p.add_(0.1 * torch.randn_like(p))
    else:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.add_(0.1 * torch.randn_like(p))
    set_rope(model, config)
    model.train()
    model.save_pretrained(d, safe_serialization=True)
    greedy = greedy_of(model, b["prompt"], b["new_tokens"])
    ids = torch.tensor(b["ids"]).reshape(b["B"], b["T"])
    targets = torch.tensor(b["targets"]).reshape(b["B"], b["T"])
    logits, loss = loss_of(model, ids, targets)
    loss.backward()
    out = {"loss": loss.item(), "logits": logits.detach().reshape(-1).tolist(),
           "grads": {n: p.grad.reshape(-1).tolist() for n, p in model.named_parameters()}, **greedy}
    # Weight decay on matrices and embeddings, not on biases and norms, as loom's parameter table says.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": b["weight_decay"]},
                             {"params": rest, "weight_decay": 0.0}], lr=b["lr"], betas=(0.9, 0.95), eps=1e-8)
    for _ in range(3):
        opt.zero_grad()
        loss_of(model, ids, targets)[1].backward()
        opt.step()
    out["params_after"] = {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()}
    json.dump(out, open(f"{d}/reference.json", "w"))


def logits(d):
    b = json.load(open(f"{d}/batch.json"))
    config = transformers.AutoConfig.from_pretrained(d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float64)
    set_rope(model, config)
    ids = torch.tensor(b["ids"]).reshape(b["B"], b["T"])
    with torch.no_grad():
        json.dump({"logits": model(ids).logits.reshape(-1).tolist()}, open(f"{d}/logits.json", "w"))


if __name__ == "__main__":
    patch()
    if sys.argv[1] == "make":
        for family, d in zip(sys.argv[2::2], sys.argv[3::2]):
            make(family, d)
    else:
        for d in sys.argv[2:]:
            logits(d)
