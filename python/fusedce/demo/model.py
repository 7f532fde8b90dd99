"""A small GPT-style language model in plain PyTorch: token and position embeddings, pre-norm
transformer blocks (causal self-attention through F.scaled_dot_product_attention, a GELU MLP),
a final LayerNorm and an untied output layer ``lm_head``.

``forward`` stops at the final norm and returns the hidden states: the demo's two runs differ
only in how the loss is taken from them (``lm_head`` + ``F.cross_entropy``, or
``fusedce.linear_cross_entropy`` on ``lm_head.weight``), so the model itself never forms the
logits in training.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelConfig:
    vocab: int
    seq_len: int
    d_model: int
    n_layer: int
    n_head: int


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model ({cfg.d_model}) must be a multiple of n_head ({cfg.n_head})")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self._init_weights()

    def _init_weights(self):
        """GPT-2's published recipe: N(0, 0.02) weights, zero biases, and the projections that
        write into the residual stream scaled by 1/sqrt(2 * n_layer) so its variance stays put
        with depth."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                continue
            std = 0.02
            if name.endswith(("attn.proj.weight", "out.weight")):
                std /= math.sqrt(2 * self.cfg.n_layer)
            nn.init.normal_(p, 0.0, std)

    def forward(self, idx):
        """Hidden states (B, T, d_model) after the final norm, for token ids idx (B, T)."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"idx has {t} positions, more than seq_len={self.cfg.seq_len}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    @torch.no_grad()
    def generate(self, idx, new_tokens, *, temperature=0.8, generator=None, allowed=None):
        """idx (1, T) followed by `new_tokens` sampled ids; the context is cut to the last
        seq_len tokens. Only the last position's logits are formed (one row of lm_head). Ids
        where the boolean mask `allowed` (V,) is False are never drawn (ids absent from the
        training text: an undertrained model still gives them some probability)."""
        for _ in range(new_tokens):
            h = self(idx[:, -self.cfg.seq_len:])[:, -1]
            logits = self.lm_head(h).float()
            if allowed is not None:
                logits = logits.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
