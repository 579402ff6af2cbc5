"""A decoder-only transformer language model in the GPT-2 style (pre-LN, learned positions, tied head).

Submodules::

    embed.{wte, wpe, drop}, blocks.<i>.{ln_1, attn.{q, k, v, proj}, ln_2, mlp.{fc, act, proj}}, ln_f, lm_head

The model declares its parallel plan by the methods of ``disttrain.models.protocol``: the Megatron
tensor-parallel plan over these names, the pipeline units (``embed``, each block, ``ln_f``, ``lm_head``)
and the blocks as sharding units. Query, key and value are separate ``nn.Linear`` layers so each can be
sharded column-wise on its own; attention takes the number of heads from the width of its (possibly
sharded) projections.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from disttrain import checks
from disttrain.data.spec import DataSpec
from disttrain.models.attention import SequenceSplit, causal_attention, positions_of
from disttrain.models.dims import resolve_dims, sequence_length
from disttrain.models.documents import PackedDocuments
from disttrain.models.heads import COLUMNS, ROWS, HeadBlocks
from disttrain.models.lora import LoRAConfig
from disttrain.models.registry import MODELS

FLAVOURS: dict[str, dict[str, int]] = {
    "micro": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
    "nano": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64},
    "mini": {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256},
    "gpt2": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "vocab_size": 50304},
}
"""Size presets: ``micro`` for tests, ``nano`` the CPU-sized model, ``mini`` a small GPU model and
``gpt2`` the 124M GPT-2 (vocabulary 50257 padded to 50304, used when the data gives no vocabulary)."""

_DIMS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")


@dataclass
class GPTConfig:
    """Schema of ``model: gpt``. A ``flavour`` presets the sizes; any size set here overrides it."""

    name: str = "gpt"
    """Registry key of this model."""
    flavour: str = "nano"
    """Size preset, one of micro, nano, mini, gpt2 (see ``FLAVOURS``)."""
    n_layer: int | None = None
    """Transformer blocks. None: from the flavour."""
    n_head: int | None = None
    """Attention heads per block; must divide n_embd. None: from the flavour."""
    n_embd: int | None = None
    """Model width (embedding size). None: from the flavour."""
    block_size: int | None = None
    """Longest sequence (rows of the position embedding). None: the data's block size, else the flavour's."""
    vocab_size: int | None = None
    """Token embedding rows; at least the data's vocabulary. None: the data's, else the flavour's."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches."""
    bias: bool = True
    """Biases in the Linear and LayerNorm layers."""
    tie_weights: bool = True
    """Share the LM head's weight with the token embedding. Tensor or pipeline parallelism may untie it."""
    attention_fp32: bool | None = None
    """Under bf16, attend in fp32 (true) or bf16 (false). None: fp32 on a CPU at short sequences and narrow
    heads, where torch's bf16 kernel is the slower one (``disttrain.models.attention``)."""
    init_weights: str | None = None
    """A safetensors file of this model's ``state_dict()`` to start from instead of the seeded initialisation
    (``disttrain.checkpoint.init_weights``); not a ``resume``: step 0, a fresh optimiser. None: the seeded init."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters through PEFT (``model.lora.rank=16``), the rest of the model frozen; off by default
    (``disttrain.models.lora``)."""

    def validate(self, spec: DataSpec) -> GPTDims:
        """Raise ConfigError if this config cannot build a model for ``spec``; return the resolved sizes."""
        checks.probability("model.dropout", self.dropout)
        return resolve_gpt_dims(self, spec)


@dataclass(frozen=True)
class GPTDims:
    """The sizes of a GPT after flavour, config and data have been combined."""

    n_layer: int
    """Transformer blocks."""
    n_head: int
    """Attention heads per block."""
    n_embd: int
    """Model width."""
    block_size: int
    """Longest sequence the position embedding covers."""
    vocab_size: int
    """Rows of the token embedding (columns of the logits)."""

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.n_embd // self.n_head


def resolve_gpt_dims(cfg: GPTConfig, spec: DataSpec) -> GPTDims:
    """Combine flavour, explicit sizes and the data's spec into checked sizes; ConfigError if impossible."""
    return GPTDims(**resolve_dims(cfg, spec, "gpt", FLAVOURS, _DIMS))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k, v projections and an output projection."""

    sequence_split: SequenceSplit | None = None
    """Set by context parallelism: this rank holds a slice of each sequence, attention covers all of it."""
    documents: PackedDocuments | None = None
    """Set for packed windows: attention stays within each document (None: over the whole window)."""

    def __init__(
        self, n_embd: int, n_head: int, dropout: float, bias: bool, attention_fp32: bool | None = None
    ) -> None:
        super().__init__()
        self.head_dim = n_embd // n_head
        self.attention_fp32 = attention_fp32
        self.q = nn.Linear(n_embd, n_embd, bias=bias)
        self.k = nn.Linear(n_embd, n_embd, bias=bias)
        self.v = nn.Linear(n_embd, n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over earlier positions: ``[B, T, C] -> [B, T, C]``."""
        b, t, _ = x.shape
        # The head count follows from the projection width, so column-sharded q/k/v carry a subset of heads.
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        p = self.dropout if self.training else 0.0
        y = causal_attention(q, k, v, dropout_p=p, fp32=self.attention_fp32, split=self.sequence_split,
                             documents=self.documents)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, -1)))


class MLP(nn.Module):
    """Position-wise feed-forward network: ``fc`` to 4x width, GELU, ``proj`` back."""

    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, C] -> [B, T, C]``."""
        return self.drop(self.proj(self.act(self.fc(x))))


class Embeddings(nn.Module):
    """Token plus learned position embeddings, then dropout: token ids ``[B, T]`` to ``[B, T, C]``."""

    sequence_split: SequenceSplit | None = None
    """Set by context parallelism: the tokens are this rank's slice of each sequence, at the positions it says."""
    documents: PackedDocuments | None = None
    """Set for packed windows: the embedding reads their documents, and positions restart at each."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Embed token ids ``[B, T]`` (``T <= block_size``)."""
        t = sequence_length(idx, self.block_size)
        if self.documents is None:
            positions = positions_of(t, idx.device, self.sequence_split)
        else:
            self.documents.read(idx, self.sequence_split)
            positions = self.documents.positions(self.sequence_split)
        return self.drop(self.wte(idx) + self.wpe(positions))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(
        self, n_embd: int, n_head: int, dropout: float, bias: bool, attention_fp32: bool | None = None
    ) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias, attention_fp32)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, C] -> [B, T, C]``."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Embeddings, ``blocks`` (the sharding / checkpointing units), final LN, LM head.

    ``forward`` maps token ids ``[B, T]`` to logits ``[B, T, vocab_size]``; the loss is computed outside.
    """

    def __init__(
        self, dims: GPTDims, dropout: float = 0.0, bias: bool = True, tie_weights: bool = True,
        attention_fp32: bool | None = None, document_end: int | None = None,
    ) -> None:
        """``document_end``: the token that closes each document of packed windows, whose documents then attend
        only within themselves (``disttrain.models.documents``); None: each window is one sequence."""
        super().__init__()
        self.dims = dims
        self.embed = Embeddings(dims.vocab_size, dims.block_size, dims.n_embd, dropout)
        self.blocks = nn.ModuleList(
            Block(dims.n_embd, dims.n_head, dropout, bias, attention_fp32) for _ in range(dims.n_layer)
        )
        self.ln_f = nn.LayerNorm(dims.n_embd, bias=bias)
        self.lm_head = nn.Linear(dims.n_embd, dims.vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.embed.wte.weight
        if document_end is not None:
            documents = PackedDocuments(document_end)
            for module in (self.embed, *(block.attn for block in self.blocks)):
                module.documents = documents
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02) weights, zero biases, residual projections scaled by 1/sqrt(2 n_layer)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * self.dims.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)

    @property
    def tied(self) -> bool:
        """Whether the LM head shares its weight with the token embedding."""
        return self.lm_head.weight is self.embed.wte.weight

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count (shared tensors once). ``non_embedding`` leaves out the lookup tables: the
        position embedding, and the token embedding too when it is not also the LM head's weight."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.embed.wpe.weight.numel()
            if not self.tied:
                n -= self.embed.wte.weight.numel()
        return n

    def tp_plan(self) -> dict[str, str]:
        """Megatron plan: q, k, v and the first MLP layer column-wise, the output projections row-wise.

        The embeddings, the final norm and the LM head stay replicated (every tp rank projects the full
        vocabulary), which keeps the head tied to the token embedding exactly as without tp. With sequence
        parallelism the residual stream is split along the sequence between the sharded layers.
        """
        return {
            "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
            "blocks.*.attn.proj": "rowwise", "blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise",
            "embed": "sequence_split", "blocks.*.ln_1": "sequence_norm", "blocks.*.attn": "sequence_gather",
            "blocks.*.ln_2": "sequence_norm", "blocks.*.mlp": "sequence_gather", "ln_f": "sequence_norm",
            "lm_head": "sequence_gather",
        }

    def tp_sizes(self) -> dict[str, int]:
        """Each tp rank holds whole attention heads."""
        return {"model.n_head": self.dims.n_head}

    def attention_heads(self) -> dict[str, HeadBlocks]:
        """q, k and v stack their heads by rows, the output projection by columns."""
        width = self.dims.head_dim
        return {**{f"blocks.*.attn.{name}.weight": HeadBlocks(ROWS, width) for name in ("q", "k", "v")},
                "blocks.*.attn.proj.weight": HeadBlocks(COLUMNS, width)}

    def pipeline_units(self) -> list[str]:
        """Embeddings, each block, final norm, head: applied in turn they are ``forward``."""
        return ["embed", "blocks", "ln_f", "lm_head"]

    def shard_units(self) -> list[str]:
        """One FSDP unit (and activation-checkpointing unit) per block."""
        return ["blocks"]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[B, T, vocab_size]`` of token ids ``[B, T]`` (``T <= block_size``)."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@MODELS.register("gpt", GPTConfig)
def build_gpt(cfg: GPTConfig, spec: DataSpec) -> GPT:
    """Build the GPT that ``cfg`` describes for the text of ``spec``."""
    dims = cfg.validate(spec)
    return GPT(dims, dropout=cfg.dropout, bias=cfg.bias, tie_weights=cfg.tie_weights,
               attention_fp32=cfg.attention_fp32, document_end=spec.document_end)
