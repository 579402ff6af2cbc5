"""``trainer.compile``: the compiled model computes what the eager one does and keeps its parameter names."""

from __future__ import annotations

import torch

from disttrain.data.spec import DataSpec
from disttrain.models.gpt import GPTConfig, build_gpt
from disttrain.parallel.compile import compile_model
from disttrain.parallel.model_plan import shard_units_of


def test_a_compiled_gpt_matches_eager_and_keeps_its_names():
    torch.manual_seed(0)
    spec = DataSpec(kind="text", vocab_size=256, block_size=16)
    eager = build_gpt(GPTConfig(flavour="micro"), spec)
    compiled = build_gpt(GPTConfig(flavour="micro"), spec)
    compiled.load_state_dict(eager.state_dict())
    compile_model(compiled, shard_units_of(compiled), per_unit=True)
    assert list(compiled.state_dict()) == list(eager.state_dict())  # checkpoints and exports read the same
    tokens = torch.randint(0, 256, (4, 16))
    grads = []
    for model in (eager, compiled):
        loss = model(tokens).logsumexp(-1).mean()
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    # fused kernels reorder float sums: measured 4e-7 relative
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-6)
    assert any(getattr(block, "_compiled_call_impl", None) is not None for block in compiled.modules())
