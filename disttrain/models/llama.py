"""A decoder-only transformer language model in the Llama style.

Pre-norm blocks with RMSNorm, rotary position embeddings on queries and keys, grouped-query attention
(fewer key/value heads than query heads), a SwiGLU feed-forward network and an untied output layer.

Submodules::

    embed.{tok, drop},
    layers.<i>.{attention_norm, attention.{q, k, v, o}, ffn_norm, feed_forward.{w1, w2, w3}},
    norm, output

The model declares its parallel plan by the methods of ``disttrain.models.protocol``: the Megatron
tensor-parallel plan over these names, the pipeline units (``embed``, each layer, ``norm``, ``output``)
and the layers as sharding units. The rotary angles are computed in ``forward`` from the sequence length
rather than kept in buffers, so the model builds on the meta device and a pipeline stage needs nothing
beyond its own modules. Attention takes its query and key/value head counts from the widths of its
(possibly column-sharded) projections.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from disttrain import checks
from disttrain.data.spec import DataSpec
from disttrain.errors import ConfigError
from disttrain.models.attention import SequenceSplit, causal_attention, positions_of
from disttrain.models.dims import resolve_dims, sequence_length
from disttrain.models.documents import PackedDocuments
from disttrain.models.heads import COLUMNS, ROWS, HeadBlocks
from disttrain.models.llama_hf import SIZES, hf_llama_sources, import_hf_llama, read_hf_llama
from disttrain.models.lora import LoRAConfig
from disttrain.models.registry import MODELS

FLAVOURS: dict[str, dict[str, int]] = {
    "micro": {"n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "block_size": 32},
    "nano": {"n_layer": 4, "n_head": 4, "n_kv_head": 2, "n_embd": 128, "block_size": 64},
    "small": {"n_layer": 12, "n_head": 12, "n_kv_head": 4, "n_embd": 768, "block_size": 1024},
}
"""Size presets: ``micro`` for tests, ``nano`` the CPU-sized model, ``small`` a GPT-2-small-sized model with
three query heads per key/value head. None sets a vocabulary: it comes from the data (or ``vocab_size``)."""

_DIMS = ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "vocab_size")


@dataclass
class LlamaConfig:
    """Schema of ``model: llama``. A ``flavour`` presets the sizes; any size set here overrides it."""

    name: str = "llama"
    """Registry key of this model."""
    flavour: str = "nano"
    """Size preset, one of micro, nano, small (see ``FLAVOURS``)."""
    n_layer: int | None = None
    """Transformer blocks. None: from the flavour."""
    n_head: int | None = None
    """Query heads per block; must divide n_embd into an even head width. None: from the flavour."""
    n_kv_head: int | None = None
    """Key/value heads per block, each shared by n_head / n_kv_head query heads; must divide n_head.
    Equal to n_head: plain multi-head attention. None: from the flavour."""
    n_embd: int | None = None
    """Model width (embedding size). None: from the flavour."""
    block_size: int | None = None
    """Longest sequence the model accepts. None: the data's block size, else the flavour's."""
    vocab_size: int | None = None
    """Token embedding rows (and output columns); at least the data's vocabulary. None: the data's."""
    mlp_hidden: int | None = None
    """Hidden width of the SwiGLU feed-forward network. None: 8/3 * n_embd rounded up to a multiple of
    multiple_of (the same parameter count as a 4x GELU MLP, since SwiGLU has three matrices)."""
    multiple_of: int = 32
    """The default mlp_hidden is rounded up to a multiple of this (friendlier shapes for matmul kernels)."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding's frequencies; larger bases rotate more slowly."""
    norm_eps: float = 1e-5
    """Epsilon added to the mean square in every RMSNorm."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches."""
    attention_fp32: bool | None = None
    """Under bf16, attend in fp32 (true) or bf16 (false). None: fp32 on a CPU at short sequences and narrow
    heads, where torch's bf16 kernel is the slower one (``disttrain.models.attention``)."""
    init_from: str | None = None
    """A Hugging Face Llama folder (config.json and safetensors weights) whose weights the model starts from,
    loaded on the CPU when the model is built, before any parallelism. Sizes left null come from its
    config.json (not the flavour); sizes set, rope_theta and norm_eps must equal its own. An HF model with tied
    embeddings starts with the output layer a copy of the embedding. Its tensors' names, shapes and dtypes are
    checked against the model from their headers before any rank starts. None: random initialisation."""
    init_weights: str | None = None
    """A safetensors file of this model's ``state_dict()`` to start from instead of the seeded initialisation
    (``disttrain.checkpoint.init_weights``); not a ``resume``: step 0, a fresh optimiser. None: the seeded init."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters through PEFT (``model.lora.rank=16``), the rest of the model frozen; off by default
    (``disttrain.models.lora``)."""

    def validate(self, spec: DataSpec) -> LlamaDims:
        """Raise ConfigError if this config cannot build a model for ``spec``; return the resolved sizes."""
        if self.init_from is not None:
            return self._with_sizes_of_init_from().validate(spec)
        checks.probability("model.dropout", self.dropout)
        if self.multiple_of <= 0:
            raise ConfigError("model.multiple_of", self.multiple_of, "a positive integer")
        if self.mlp_hidden is not None and self.mlp_hidden <= 0:
            raise ConfigError("model.mlp_hidden", self.mlp_hidden, "a positive integer, or null for the default")
        if not self.rope_theta > 0:
            raise ConfigError("model.rope_theta", self.rope_theta, "a positive number")
        if not self.norm_eps > 0:
            raise ConfigError("model.norm_eps", self.norm_eps, "a positive number")
        return resolve_llama_dims(self, spec)

    def _with_sizes_of_init_from(self) -> LlamaConfig:
        """This config with its null sizes taken from ``init_from``'s config.json (and ``init_from`` cleared);
        ConfigError where a size or setting given here differs from the folder's. Its safetensors weights are held
        against the model when it is built (``build_llama``: on the meta device, by the job, from their headers)."""
        hf = read_hf_llama(self.init_from)
        for key in SIZES:
            given = getattr(self, key)
            if given is not None and given != hf.sizes[key]:
                raise ConfigError(f"model.{key}", given, f"{hf.sizes[key]} (model.init_from's size) or null")
        for key, theirs in (("rope_theta", hf.rope_theta), ("norm_eps", hf.norm_eps)):
            if getattr(self, key) != theirs:
                raise ConfigError(f"model.{key}", getattr(self, key), f"{theirs}, the value of model.init_from "
                                                                     f"{self.init_from} (set model.{key}={theirs})")
        return dataclasses.replace(self, init_from=None, **hf.sizes)


@dataclass(frozen=True)
class LlamaDims:
    """The sizes of a Llama after flavour, config and data have been combined."""

    n_layer: int
    """Transformer blocks."""
    n_head: int
    """Query heads per block."""
    n_kv_head: int
    """Key/value heads per block."""
    n_embd: int
    """Model width."""
    block_size: int
    """Longest sequence the model accepts."""
    vocab_size: int
    """Rows of the token embedding (columns of the logits)."""
    mlp_hidden: int
    """Hidden width of the feed-forward network."""

    @property
    def head_dim(self) -> int:
        """Width of one attention head (query, key and value alike)."""
        return self.n_embd // self.n_head


def default_mlp_hidden(n_embd: int, multiple_of: int) -> int:
    """SwiGLU's hidden width: ``8/3 * n_embd`` rounded up to a multiple of ``multiple_of``."""
    # exact integer ceiling of 8 n / (3 m), so no float rounding can move the result by a multiple
    return -(-8 * n_embd // (3 * multiple_of)) * multiple_of


def resolve_llama_dims(cfg: LlamaConfig, spec: DataSpec) -> LlamaDims:
    """Combine flavour, explicit sizes and the data's spec into checked sizes; ConfigError if impossible."""
    dims = resolve_dims(cfg, spec, "llama", FLAVOURS, _DIMS, check_heads=_check_heads)
    hidden = cfg.mlp_hidden if cfg.mlp_hidden is not None else default_mlp_hidden(dims["n_embd"], cfg.multiple_of)
    return LlamaDims(**dims, mlp_hidden=hidden)


def _check_heads(dims: dict[str, int]) -> None:
    """What rotary embeddings and grouped-query attention need of the heads; ConfigError if they cannot have it."""
    n_embd, n_head, n_kv_head = dims["n_embd"], dims["n_head"], dims["n_kv_head"]
    if (n_embd // n_head) % 2:
        raise ConfigError("model.n_head", n_head, f"a divisor of model.n_embd={n_embd} that leaves an even head "
                          f"width (rotary embeddings rotate pairs of features); {n_embd}/{n_head} is odd")
    if n_head % n_kv_head:
        raise ConfigError("model.n_kv_head", n_kv_head, f"a divisor of model.n_head={n_head}")


def apply_rotary(x: torch.Tensor, theta: float = 10000.0, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate each pair of features ``(2i, 2i+1)`` of ``x`` ``[B, H, T, D]`` by the angle ``t * theta**(-2i/D)``
    of its position ``t`` (rotary position embedding); ``positions`` (``[T]``, or ``[B, T]`` where each sequence
    places its tokens on its own; default ``0 .. T-1``) says where the tokens sit in their sequence.

    The dot product of a rotated query at position ``s`` and a rotated key at position ``t`` then depends on
    the positions only through ``s - t``.
    """
    t, d = x.shape[-2], x.shape[-1]
    # float32 angles and products: in bf16 the angles of late positions lose most of their precision
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    if positions is None:
        positions = torch.arange(t, device=x.device)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [T, D/2] or [B, T, D/2]
    cos, sin = angles.cos(), angles.sin()
    if angles.dim() == 3:  # one set of angles per sequence, shared by its heads
        cos, sin = cos[:, None], sin[:, None]
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary positions and bias-free q, k, v, o projections."""

    sequence_split: SequenceSplit | None = None
    """Set by context parallelism: this rank holds a slice of each sequence, at the positions it says, and
    attention covers all of it."""
    documents: PackedDocuments | None = None
    """Set for packed windows: attention stays within each document, whose positions start at 0."""

    def __init__(self, n_embd: int, n_head: int, n_kv_head: int, dropout: float, rope_theta: float,
                 attention_fp32: bool | None = None) -> None:
        super().__init__()
        self.head_dim = n_embd // n_head
        self.attention_fp32 = attention_fp32
        self.rope_theta = rope_theta
        self.q = nn.Linear(n_embd, n_head * self.head_dim, bias=False)
        self.k = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.v = nn.Linear(n_embd, n_kv_head * self.head_dim, bias=False)
        self.o = nn.Linear(n_head * self.head_dim, n_embd, bias=False)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over earlier positions: ``[B, T, C] -> [B, T, C]``."""
        b, t, _ = x.shape
        # Head counts follow from the projection widths, so column-sharded q, k and v carry a subset of the
        # query heads and the matching subset of the key/value heads.
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        if self.documents is None:
            positions = positions_of(t, x.device, self.sequence_split)
        else:
            positions = self.documents.positions(self.sequence_split)
        q, k = apply_rotary(q, self.rope_theta, positions), apply_rotary(k, self.rope_theta, positions)
        p = self.dropout if self.training else 0.0
        # key/value heads fewer than query heads are shared inside (after gathering them, under a split)
        y = causal_attention(q, k, v, dropout_p=p, fp32=self.attention_fp32, split=self.sequence_split,
                             documents=self.documents)
        return self.resid_drop(self.o(y.transpose(1, 2).reshape(b, t, -1)))


class FeedForward(nn.Module):
    """SwiGLU feed-forward network: ``w2(silu(w1 x) * w3 x)``, bias-free."""

    def __init__(self, n_embd: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(n_embd, hidden, bias=False)
        self.w3 = nn.Linear(n_embd, hidden, bias=False)
        self.w2 = nn.Linear(hidden, n_embd, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, C] -> [B, T, C]``."""
        return self.drop(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class TokenEmbedding(nn.Module):
    """Token embedding then dropout: token ids ``[B, T]`` to ``[B, T, C]`` (positions enter in attention)."""

    sequence_split: SequenceSplit | None = None
    """Set by context parallelism: the tokens are this rank's slice of each sequence (read for their documents)."""
    documents: PackedDocuments | None = None
    """Set for packed windows: the embedding reads their documents for the attention modules."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Embed token ids ``[B, T]`` (``T <= block_size``)."""
        sequence_length(idx, self.block_size)
        if self.documents is not None:
            self.documents.read(idx, self.sequence_split)
        return self.drop(self.tok(idx))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attention(attention_norm(x))`` then ``x + feed_forward(ffn_norm(x))``."""

    def __init__(self, dims: LlamaDims, dropout: float, rope_theta: float, norm_eps: float,
                 attention_fp32: bool | None = None, feed_forward: nn.Module | None = None) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dims.n_embd, eps=norm_eps)
        self.attention = Attention(dims.n_embd, dims.n_head, dims.n_kv_head, dropout, rope_theta, attention_fp32)
        self.ffn_norm = nn.RMSNorm(dims.n_embd, eps=norm_eps)
        self.feed_forward = feed_forward or FeedForward(dims.n_embd, dims.mlp_hidden, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, C] -> [B, T, C]``."""
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Token embedding, ``layers`` (the sharding / checkpointing units), final RMSNorm, output layer.

    ``forward`` maps token ids ``[B, T]`` to logits ``[B, T, vocab_size]``; the loss is computed outside.
    """

    def __init__(self, dims: LlamaDims, dropout: float = 0.0, rope_theta: float = 10000.0,
                 norm_eps: float = 1e-5, attention_fp32: bool | None = None,
                 feed_forward: Callable[[], nn.Module] | None = None, document_end: int | None = None) -> None:
        """``feed_forward``: builds each block's feed-forward network (None: the SwiGLU ``FeedForward``).
        ``document_end``: the token that closes each document of packed windows, whose documents then attend only
        within themselves (``disttrain.models.documents``); None: each window is one sequence."""
        super().__init__()
        self.dims = dims
        self.embed = TokenEmbedding(dims.vocab_size, dims.block_size, dims.n_embd, dropout)
        self.layers = nn.ModuleList(
            TransformerBlock(dims, dropout, rope_theta, norm_eps, attention_fp32,
                             feed_forward() if feed_forward is not None else None)
            for _ in range(dims.n_layer)
        )
        self.norm = nn.RMSNorm(dims.n_embd, eps=norm_eps)
        self.output = nn.Linear(dims.n_embd, dims.vocab_size, bias=False)
        if document_end is not None:
            documents = PackedDocuments(document_end)
            for module in (self.embed, *(layer.attention for layer in self.layers)):
                module.documents = documents
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02) weights (grouped experts' ``[n_experts, in, out]`` ones too), unit norm gains, residual
        projections (``o``, every ``w2``) scaled by 1/sqrt(2 n_layer) so the residual stream's variance does not
        grow with depth. Draws from torch's global generator."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
        for param in self.parameters():
            if param.dim() == 3:
                nn.init.normal_(param, mean=0.0, std=0.02)
        residual_std = 0.02 / math.sqrt(2 * self.dims.n_layer)
        for name, param in self.layers.named_parameters():
            if name.endswith(("attention.o.weight", "w2.weight", "experts.w2")):
                nn.init.normal_(param, mean=0.0, std=residual_std)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count. ``non_embedding`` leaves out the token embedding (a lookup table, no compute);
        the output layer is untied and always counted."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.embed.tok.weight.numel()
        return n

    def tp_plan(self) -> dict[str, str]:
        """Megatron plan: q, k, v, w1 and w3 column-wise, the output projections o and w2 row-wise.

        Each tp rank then holds ``n_head / tp`` query heads and the ``n_kv_head / tp`` key/value heads they
        read. The embedding, the final norm and the output layer stay replicated. With sequence parallelism
        the residual stream is split along the sequence between the sharded layers.
        """
        return {
            "layers.*.attention.q": "colwise", "layers.*.attention.k": "colwise",
            "layers.*.attention.v": "colwise", "layers.*.attention.o": "rowwise",
            "layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w3": "colwise",
            "layers.*.feed_forward.w2": "rowwise",
            "embed": "sequence_split", "layers.*.attention_norm": "sequence_norm",
            "layers.*.attention": "sequence_gather", "layers.*.ffn_norm": "sequence_norm",
            "layers.*.feed_forward": "sequence_gather", "norm": "sequence_norm", "output": "sequence_gather",
        }

    def tp_sizes(self) -> dict[str, int]:
        """Each tp rank holds whole query heads and whole key/value heads."""
        return {"model.n_head": self.dims.n_head, "model.n_kv_head": self.dims.n_kv_head}

    def attention_heads(self) -> dict[str, HeadBlocks]:
        """q, k and v stack their heads by rows (k and v the fewer key/value heads), o by columns."""
        width = self.dims.head_dim
        return {**{f"layers.*.attention.{name}.weight": HeadBlocks(ROWS, width) for name in ("q", "k", "v")},
                "layers.*.attention.o.weight": HeadBlocks(COLUMNS, width)}

    def pipeline_units(self) -> list[str]:
        """Embedding, each layer, final norm, output: applied in turn they are ``forward``."""
        return ["embed", "layers", "norm", "output"]

    def shard_units(self) -> list[str]:
        """One FSDP unit (and activation-checkpointing unit) per layer."""
        return ["layers"]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[B, T, vocab_size]`` of token ids ``[B, T]`` (``T <= block_size``)."""
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


@MODELS.register("llama", LlamaConfig)
def build_llama(cfg: LlamaConfig, spec: DataSpec) -> Llama:
    """Build the Llama that ``cfg`` describes for the text of ``spec``, starting from the weights of
    ``cfg.init_from`` where set; built on the meta device, which has no values, the folder is only held against it
    from its headers (the job's check, before any rank starts)."""
    dims = cfg.validate(spec)
    model = Llama(dims, dropout=cfg.dropout, rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps,
                  attention_fp32=cfg.attention_fp32, document_end=spec.document_end)
    if cfg.init_from is not None:
        state = model.state_dict()
        if model.output.weight.is_meta:  # no values to read into: the job's check, from the headers alone
            hf_llama_sources(cfg.init_from, state)
        else:
            model.load_state_dict(import_hf_llama(cfg.init_from, state), strict=True)
    return model
