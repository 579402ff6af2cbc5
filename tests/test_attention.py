"""Attention under bf16: where it runs in fp32, that it then computes exactly fp32 attention of the bf16
inputs (also under autocast, which would cast them back), and that both models pass the choice through."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disttrain.models import DataSpec, build_model
from disttrain.models.attention import FP32_BELOW, attends_in_fp32, causal_attention
from disttrain.models.gpt import GPTConfig
from disttrain.models.llama import LlamaConfig

TEXT = DataSpec(kind="text", vocab_size=65, block_size=16)


def qkv(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randn(shape, generator=generator).to(dtype).requires_grad_() for _ in range(3))


def test_the_cpu_rule_takes_fp32_below_the_threshold_only_for_bf16() -> None:
    short = torch.empty(2, 4, 64, 32, dtype=torch.bfloat16)  # GPT nano: T * D = 2048
    long = torch.empty(2, 4, FP32_BELOW // 64, 64, dtype=torch.bfloat16)
    assert attends_in_fp32(short) and not attends_in_fp32(long)
    assert not attends_in_fp32(short.float()) and not attends_in_fp32(short.float(), fp32=True)
    assert attends_in_fp32(long, fp32=True) and not attends_in_fp32(short, fp32=False)
    assert not attends_in_fp32(torch.empty(2, 4, 64, 32, dtype=torch.bfloat16, device="meta"))  # CPU only


@pytest.mark.parametrize("autocast", [False, True])
def test_fp32_attention_equals_the_fp32_kernel_on_the_bf16_inputs(autocast: bool) -> None:
    q, k, v = qkv((2, 4, 16, 8), torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = causal_attention(q, k, v, fp32=True)
    assert y.dtype == torch.bfloat16
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(torch.bfloat16)
    assert torch.equal(y, reference)
    native = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.equal(native, reference)  # so the check above tells the two apart
    y.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.bfloat16


def test_bf16_kernel_when_told_and_for_fp32_inputs() -> None:
    q, k, v = qkv((2, 4, 16, 8), torch.bfloat16)
    assert torch.equal(causal_attention(q, k, v, fp32=False), F.scaled_dot_product_attention(q, k, v, is_causal=True))
    q, k, v = qkv((2, 4, 16, 8), torch.float32)
    assert torch.equal(causal_attention(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("config", [GPTConfig, LlamaConfig])
@pytest.mark.parametrize("fp32", [None, True, False])
def test_models_pass_the_choice_to_every_attention(config: type, fp32: bool | None) -> None:
    model = build_model(config(flavour="micro", attention_fp32=fp32), TEXT)
    found = [m.attention_fp32 for m in model.modules() if hasattr(m, "attention_fp32")]
    assert len(found) == 2 and set(found) == {fp32}
    idx = torch.randint(0, 65, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(idx).shape == (2, 16, 65)
