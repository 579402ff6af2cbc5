"""Whether a Hugging Face folder's safetensors weights fit a model, from their headers alone.

``model.pretrained=true`` reads these files inside every rank, after the model is laid out; a file cut short, a
header that is not one, or a tensor of another shape would fail there, in every rank. ``check_weights`` reads
only the files' headers (names, shapes, dtypes, and that the data they describe fills the file, through
``disttrain.safetensors_reader``), finds where each of the model's tensors is saved (``transformers``' conversion,
``disttrain.models.hf.conversion``) and holds them against the model built on the meta device by the one rule of
starting weights (``disttrain.models.weights_fit``), so the job refuses such a folder in one line before any rank
starts.
"""

from __future__ import annotations

from typing import Any

from disttrain.models.hf.conversion import conversion_of, saved_sources
from disttrain.models.weights_fit import base_state, check_fit
from disttrain.safetensors_reader import SafetensorsFolder


def check_weights(net: Any, folder: SafetensorsFolder) -> None:
    """``folder``'s safetensors headers hold every tensor of ``net`` (a model built on the meta device, whose
    parameters and persistent buffers the folder replaces) at the model's shape and in a dtype it casts from: under
    its own name, or, for a Hugging Face model, in a layout ``transformers`` converts from (per-expert tensors of a
    mixture, ``disttrain.models.hf.conversion``). A weight tied to one the folder holds may be absent (a head
    sharing the token embedding is saved once); tensors the model does not read are left alone, as
    ``from_pretrained`` leaves them. The folder's refusal (a ConfigError on the key that named it) naming the file,
    the tensor, what the file holds and what the model needs."""
    saved = folder.headers()
    state = base_state(net)
    try:
        sources = saved_sources(state, saved, conversion_of(net))
    except ValueError as err:
        raise folder.refuse(str(err)) from None
    check_fit(state, sources, folder.refuse)


def check_starting_weights(net: Any) -> None:
    """The folder ``net`` starts from (its ``pretrained()``, when it declares one that names a folder) fits it, as
    ``check_weights`` checks."""
    starting_weights = getattr(net, "pretrained", None)
    folder = starting_weights() if callable(starting_weights) else None
    if folder is not None:
        check_weights(net, folder)
