"""The workloads of ``throughput_mfu.py`` (GPT-2 124M and a 1.2B Llama, and their test-size twins), the FLOPs a
token costs in each, the devices' bf16 peaks, and the row each measured run fills."""

from __future__ import annotations

from dataclasses import dataclass

WARMUP = 10
"""Steps left out of every side's tokens/s: compilation and autotuning in the first, and under CUDA graphs
(``compile_mode=reduce-overhead``) the warm-up and recording runs in the steps after it. disttrain's rate over
the steps after it comes from its logged rows (``windowed_tokens_per_s``)."""
VOCAB = 50304
"""GPT-2's vocabulary padded to a multiple of 64, as nanoGPT does (the byte tokens use the first 256)."""
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12,
             "L40S": 362e12, "L4": 121e12}
"""Dense bf16 tensor-core peak by device name (vendors' datasheets, SXM parts unless named), in FLOP/s;
the first name found in the device's name counts, so the longer names come first."""


@dataclass(frozen=True)
class Workload:
    """One model at one batch: the overrides that build it and the sizes the FLOP count needs."""

    name: str
    model: list[str]
    """disttrain overrides of the model group."""
    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    mlp_hidden: int
    """Hidden width of the feed-forward network (4 x width for GPT's GELU MLP, SwiGLU's for the Llama)."""
    block: int
    batch: int
    tied: bool
    """The output layer shares the token embedding."""
    swiglu: bool = False

    def params(self) -> int:
        """Weights that multiply an activation: every linear layer and the output layer (the position
        embedding is a lookup, nanoGPT's count leaves it out; norms are negligible and left out too)."""
        head = self.n_embd // self.n_head
        attention = self.n_embd * self.n_embd * 2 + 2 * self.n_embd * self.n_kv_head * head
        mlp = (3 if self.swiglu else 2) * self.n_embd * self.mlp_hidden
        embeddings = VOCAB * self.n_embd * (1 if self.tied else 2)
        return self.n_layer * (attention + mlp) + embeddings

    def flops_per_token(self) -> float:
        """6N + 12 L C T: a forward and backward pass per token (nanoGPT's estimate_mfu, PaLM appendix B)."""
        return 6 * self.params() + 12 * self.n_layer * self.n_embd * self.block

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one optimiser step."""
        return self.batch * self.block


WORKLOADS = {
    "gpt2": Workload("GPT-2 124M", ["model=gpt", "model.flavour=gpt2", "model.bias=false"],
                     12, 768, 12, 12, 3072, 1024, 12, tied=True),
    "llama1b": Workload("Llama 1.2B", ["model=llama", "model.n_layer=16", "model.n_embd=2048", "model.n_head=32",
                                       "model.n_kv_head=8", "model.mlp_hidden=8192"],
                        16, 2048, 32, 8, 8192, 2048, 4, tied=False, swiglu=True),
}
"""The workloads on a GPU, by the name ``--cases`` takes."""
CPU_WORKLOADS = {
    "gpt2": Workload("GPT micro", ["model=gpt", "model.flavour=micro", "model.bias=false"],
                     2, 32, 2, 2, 128, 32, 4, tied=True),
    "llama1b": Workload("Llama micro", ["model=llama", "model.flavour=micro", "model.mlp_hidden=96"],
                        2, 32, 4, 2, 96, 32, 4, tied=False, swiglu=True),
}
"""The same table's workloads at test sizes, for ``--device cpu``."""


@dataclass
class Row:
    """One measured run."""

    workload: str
    side: str
    tokens_per_s: float | None = None
    loss: float | None = None
    peak_gb: float | None = None
    predicted_gb: float | None = None
    joules_per_token: float | None = None
    """The GPU's energy per token after the first ``WARMUP`` steps (NVML's counter; None where unread)."""
    note: str = ""
