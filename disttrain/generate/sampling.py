"""The sampling loop: a prompt's tokens extended one next-token prediction at a time."""

from __future__ import annotations

import torch
from torch import nn


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of ``logits`` ``[B, vocab]``, as ``[B, 1]``: the most likely at temperature 0, else
    drawn from the softmax of ``logits / temperature`` over the ``top_k`` most likely (all when None or 0)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    k = logits.size(-1) if not top_k else min(top_k, logits.size(-1))
    best, ids = torch.topk(logits / temperature, k, dim=-1)
    choice = torch.multinomial(torch.softmax(best, dim=-1), 1, generator=generator)
    return ids.gather(-1, choice)


@torch.no_grad()
def sample(model: nn.Module, prompt: list[int], max_new_tokens: int, block_size: int, temperature: float = 0.8,
           top_k: int | None = 50, vocab_size: int | None = None,
           generator: torch.Generator | None = None) -> list[int]:
    """``prompt`` followed by ``max_new_tokens`` tokens that ``model`` (token ids ``[B, T]`` -> logits
    ``[B, T, vocab]``) predicts, each from the last ``block_size`` tokens (the positions the model was trained
    on); only ids below ``vocab_size`` (the data's vocabulary, where the model's is larger) are chosen."""
    if not prompt:
        raise ValueError("a prompt of at least one token is needed to predict the next")
    model.eval()
    device = next(model.parameters()).device
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    # the whole window is recomputed each step: the models keep no key/value cache, and the window slides
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -block_size:])[:, -1, :vocab_size].float()
        tokens = torch.cat([tokens, next_token(logits, temperature, top_k, generator)], dim=1)
    return tokens[0].tolist()
