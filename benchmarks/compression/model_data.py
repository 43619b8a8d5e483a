"""Realistic checkpoint tensors for the compression benchmark.

Builds a small GPT-like transformer (token embedding tied to the LM head,
pre-LayerNorm blocks of attention + 4x MLP), initialises it the way GPT-2 /
Megatron do (normal(0, 0.02), residual projections scaled by 1/sqrt(2 * layers),
LayerNorm weight 1 / bias 0), and trains it for a few AdamW steps on random
tokens so that weights, ``exp_avg`` and ``exp_avg_sq`` have realistic
distributions. Returns flat numpy byte arrays per data kind.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from torch import nn


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        out: torch.Tensor = x + self.proj(nn.functional.gelu(self.fc(self.ln2(x))))
        return out


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out_proj.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif "ln" in name and name.endswith("weight"):
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        for b in self.blocks:
            x = b(x, mask)
        logits: torch.Tensor = self.ln_f(x) @ self.tok.weight.t()
        return logits


def make_data(
    *,
    vocab: int = 16384,
    d: int = 768,
    layers: int = 4,
    steps: int = 20,
    batch: int = 4,
    seq: int = 64,
    seed: int = 0,
    verbose: bool = True,
) -> dict[str, np.ndarray]:
    """Train briefly and return ``{kind: uint8 array}`` of the concatenated tensors."""
    torch.manual_seed(seed)
    model = TinyGPT(vocab, d, layers, max(1, d // 64), seq)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    t0 = time.perf_counter()
    for _ in range(steps):
        idx = torch.randint(0, vocab, (batch, seq + 1))
        logits = model(idx[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    if verbose:
        n = sum(p.numel() for p in model.parameters())
        print(f"trained {n / 1e6:.1f}M params for {steps} steps in {time.perf_counter() - t0:.1f}s")
    params = [p.detach() for p in model.parameters()]
    state = [opt.state[p] for p in model.parameters()]

    def cat(ts: list[torch.Tensor]) -> np.ndarray:
        flat = torch.cat([t.reshape(-1) for t in ts])
        return flat.view(torch.uint8).numpy()

    return {
        "bf16 weights": cat([p.to(torch.bfloat16) for p in params]),
        "fp32 weights": cat(params),
        "adam exp_avg": cat([s["exp_avg"] for s in state]),
        "adam exp_avg_sq": cat([s["exp_avg_sq"] for s in state]),
    }
