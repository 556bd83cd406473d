"""A small Qwen3-shaped ``torch.nn.Module`` for examples, tests and smoke checks.

``ToyQwen3(model)`` takes a registered model name or a config.json directory (see
``wsync.model_metadata``) and builds a real decoder (RMSNorm, grouped-query attention with
q/k norms, SwiGLU MLP) whose ``state_dict()`` has exactly the Hugging Face names, shapes
and dtype a ``wsync serve --model ...`` server holds, in checkpoint order; so
``StateDictSource(model)`` syncs it as it is. ``write_config`` writes a tiny config.json a
server and this module can both read. Dense Qwen3 only. Needs torch.
"""

import json
import math
import os

import torch
from torch import nn

from wsync.sources import model_metadata

__all__ = ["ToyQwen3", "write_config"]


def write_config(directory, vocab_size=512, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, dtype="float32", tie_word_embeddings=False):
    """Writes ``directory/config.json`` for a dense Qwen3 of these sizes; returns the directory."""
    os.makedirs(directory, exist_ok=True)
    config = {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers, "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads, "head_dim": head_dim,
        "tie_word_embeddings": tie_word_embeddings, "torch_dtype": dtype,
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return str(directory)


class _RMSNorm(nn.Module):
    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _Attention(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = _RMSNorm(head_dim)
        self.k_norm = _RMSNorm(head_dim)

    def forward(self, x):
        batch, seq, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, seq, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        repeat = self.heads // self.kv_heads
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
        mask = torch.full((seq, seq), float("-inf"), dtype=x.dtype).triu(1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + mask
        return self.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, -1))


class _Mlp(nn.Module):
    def __init__(self, hidden, intermediate):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, hidden, intermediate, heads, kv_heads, head_dim):
        super().__init__()
        self.self_attn = _Attention(hidden, heads, kv_heads, head_dim)
        self.mlp = _Mlp(hidden, intermediate)
        self.input_layernorm = _RMSNorm(hidden)
        self.post_attention_layernorm = _RMSNorm(hidden)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Decoder(nn.Module):
    def __init__(self, vocab, hidden, intermediate, layers, heads, kv_heads, head_dim):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            _Layer(hidden, intermediate, heads, kv_heads, head_dim) for _ in range(layers))
        self.norm = _RMSNorm(hidden)

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class ToyQwen3(nn.Module):
    """A Qwen3 decoder with the tensors of ``model`` (a registered name or config dir).

    Parameters start random (``seed``); ``forward(tokens)`` returns logits and
    ``loss(tokens)`` the next-token cross-entropy, so a few optimizer steps change every
    tensor. ``state_dict()`` lists exactly ``model_metadata(model)``, in its order.
    """

    def __init__(self, model="qwen3-tiny", seed=0):
        super().__init__()
        tensors = model_metadata(model)
        shapes = {name: shape for name, _, shape in tensors}
        dtypes = {dtype for _, dtype, _ in tensors}
        if len(dtypes) != 1:
            raise ValueError(f"{model}: mixed dtypes {sorted(dtypes)}")
        vocab, hidden = shapes["model.embed_tokens.weight"]
        head_dim = shapes["model.layers.0.self_attn.q_norm.weight"][0]
        torch.manual_seed(seed)
        self.model = _Decoder(
            vocab=vocab, hidden=hidden,
            intermediate=shapes["model.layers.0.mlp.gate_proj.weight"][0],
            layers=sum(1 for n in shapes if n.endswith(".input_layernorm.weight")),
            heads=shapes["model.layers.0.self_attn.q_proj.weight"][0] // head_dim,
            kv_heads=shapes["model.layers.0.self_attn.k_proj.weight"][0] // head_dim,
            head_dim=head_dim)
        self.tied = "lm_head.weight" not in shapes
        if not self.tied:
            self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.to(getattr(torch, dtypes.pop()))
        got = [(n, tuple(t.shape)) for n, t in self.state_dict().items()]
        want = [(n, tuple(s)) for n, _, s in tensors]
        if got != want:
            raise ValueError(f"{model}: the toy module's tensors differ from model_metadata: "
                             f"{sorted(set(got) ^ set(want))[:4]}")

    def forward(self, tokens):
        """Logits ([batch, seq, vocab]) for ``tokens`` ([batch, seq] int64)."""
        x = self.model(tokens)
        head = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return x @ head.T

    def loss(self, tokens):
        """Next-token cross-entropy of ``tokens`` ([batch, seq] int64)."""
        logits = self.forward(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                           tokens[:, 1:].reshape(-1))
