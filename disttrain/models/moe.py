"""A mixture-of-experts decoder: the Llama of ``disttrain.models.llama`` with every feed-forward network replaced by
a mixture of SwiGLU experts (``disttrain.models.experts``), as Mixtral, Qwen3-MoE and DeepSeek-V3 are built.

Submodules::

    embed.tok, layers.<i>.{attention_norm, attention.{q, k, v, o}, ffn_norm,
                           feed_forward.{router, experts.{w1, w2, w3}, shared.{w1, w2, w3}}}, norm, output

Its parallel plan: attention is tensor-parallel as Llama's; the mixture layers are not (every tp rank runs them
on the same tokens) and take whole sequences, so sequence parallelism is refused. Experts are split over ranks
by ``parallel.ep`` (``disttrain.parallel.experts``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from disttrain.data.spec import DataSpec
from disttrain.errors import ConfigError
from disttrain.models.experts import MoEFeedForward
from disttrain.models.llama import FeedForward, Llama, LlamaConfig, LlamaDims
from disttrain.models.registry import MODELS


@dataclass
class MoEConfig(LlamaConfig):
    """Schema of ``model: moe``: Llama's sizes (a ``flavour`` presets them) plus the mixture's."""

    name: str = "moe"
    """Registry key of this model."""
    n_experts: int = 8
    """Experts in every mixture layer (``parallel.ep`` must divide it)."""
    top_k: int = 2
    """Experts each token is sent to."""
    expert_hidden: int | None = None
    """Hidden width of each expert. None: the dense Llama's SwiGLU width (``mlp_hidden``, or 8/3 n_embd rounded
    up to ``multiple_of``) divided among the experts a token uses (top_k, plus the shared one), rounded up to a
    multiple of 8, so a token meets about the dense model's feed-forward parameters."""
    shared_expert: bool = False
    """Add one expert of width expert_hidden that every token passes through (DeepSeek-V3, Qwen2-MoE)."""
    aux_loss_coef: float = 0.001
    """Weight of the sequence-wise balance loss (``disttrain.models.experts``), a small complement to the bias
    balancing as in DeepSeek-V3 (which used 0.0001; Switch-style training with no bias uses about 0.01); 0: none."""
    bias_update_rate: float = 0.001
    """Auxiliary-loss-free balancing (DeepSeek-V3's rate): each expert's routing bias moves by this much per
    optimiser step towards the mean load; 0: off (the bias then takes no part in routing)."""
    capacity_factor: float | None = None
    """None: every assignment is computed (no drops). A number c: each expert takes at most
    ceil(c x sequence length x top_k / n_experts) tokens of a sequence, the earliest first; the rest are dropped
    (the residual stream carries them on)."""

    def validate(self, spec: DataSpec) -> MoEDims:
        """Raise ConfigError if this config cannot build a model for ``spec``; return the resolved sizes."""
        if self.init_from is not None:
            raise ConfigError("model.init_from", self.init_from, "null for model=moe (it starts from random "
                              "weights; a Hugging Face mixture-of-experts model trains as model=hf)")
        if self.n_experts < 2:
            raise ConfigError("model.n_experts", self.n_experts, "at least 2 experts")
        if not 1 <= self.top_k <= self.n_experts:
            raise ConfigError("model.top_k", self.top_k, f"between 1 and model.n_experts={self.n_experts}")
        if self.expert_hidden is not None and self.expert_hidden <= 0:
            raise ConfigError("model.expert_hidden", self.expert_hidden, "a positive width, or null for the default")
        if self.aux_loss_coef < 0:
            raise ConfigError("model.aux_loss_coef", self.aux_loss_coef, "0 (off) or a positive weight")
        if self.bias_update_rate < 0:
            raise ConfigError("model.bias_update_rate", self.bias_update_rate, "0 (off) or a positive step size")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError("model.capacity_factor", self.capacity_factor, "null (no drops) or a positive factor")
        llama = super().validate(spec)
        active = self.top_k + int(self.shared_expert)
        hidden = self.expert_hidden or 8 * math.ceil(llama.mlp_hidden / active / 8)
        return MoEDims(**dataclasses.asdict(llama), n_experts=self.n_experts, top_k=self.top_k, expert_hidden=hidden)


@dataclass(frozen=True)
class MoEDims(LlamaDims):
    """A mixture-of-experts decoder's sizes."""

    n_experts: int = 8
    """Experts per mixture layer."""
    top_k: int = 2
    """Experts per token."""
    expert_hidden: int = 0
    """Hidden width of each expert."""


class MoETransformer(Llama):
    """Llama with mixture-of-experts feed-forward layers; ``forward`` maps token ids to logits."""

    def __init__(self, dims: MoEDims, cfg: MoEConfig, document_end: int | None = None) -> None:
        """``document_end``: as Llama's (packed windows attend within each document); a capacity factor still
        counts a window's tokens together."""
        def mixture() -> MoEFeedForward:
            shared = FeedForward(dims.n_embd, dims.expert_hidden, 0.0) if cfg.shared_expert else None
            return MoEFeedForward(dims.n_embd, dims.n_experts, dims.top_k, dims.expert_hidden, shared,
                                  cfg.aux_loss_coef, cfg.bias_update_rate, cfg.capacity_factor, cfg.dropout)

        super().__init__(dims, dropout=cfg.dropout, rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps,
                         attention_fp32=cfg.attention_fp32, feed_forward=mixture, document_end=document_end)

    def active_params(self, non_embedding: bool = True) -> int:
        """Parameters one token's forward uses: everything but the experts it is not routed to."""
        dims = self.dims
        idle = (dims.n_experts - dims.top_k) * 3 * dims.n_embd * dims.expert_hidden * dims.n_layer
        return self.num_params(non_embedding) - idle

    def tp_plan(self) -> dict[str, str]:
        """Attention as Llama's (q, k, v column-wise, o row-wise); the mixture layers stay whole on every rank."""
        return {name: style for name, style in super().tp_plan().items()
                if not name.startswith("layers.*.feed_forward") and style in ("colwise", "rowwise")}


@MODELS.register("moe", MoEConfig)
def build_moe(cfg: MoEConfig, spec: DataSpec) -> MoETransformer:
    """Build the mixture-of-experts decoder that ``cfg`` describes for the text of ``spec``."""
    return MoETransformer(cfg.validate(spec), cfg, spec.document_end)
