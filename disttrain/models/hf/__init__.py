"""Hugging Face causal language models (``model=hf``): any architecture ``transformers`` can build, under
disttrain's protocol.

``config`` checks the model node before any rank starts; ``model`` builds the network (registered as ``hf``);
``attention`` lets it attend over a sequence split; ``tp_plan``, ``pipeline`` and ``experts`` read the tensor,
pipeline and expert plans its config declares; ``balance`` trains on its router's balance loss; ``weights`` checks
a folder's safetensors headers against the model and ``conversion`` maps them onto its tensors (both reading
through ``disttrain.safetensors_reader``).
"""

from __future__ import annotations

from disttrain.models.hf.config import CONFIG_FILE, HFConfig
from disttrain.models.hf.model import HFCausalLM, build_hf

__all__ = ["CONFIG_FILE", "HFCausalLM", "HFConfig", "build_hf"]
