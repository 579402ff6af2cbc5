"""The ``model=hf`` config: a ``transformers`` causal language model from a local folder or a model type, checked
before any rank starts.

``model=hf model.path=DIR`` builds the model that ``DIR/config.json`` describes; ``model=hf model.arch=llama
+model.hidden_size=256 ...`` builds a model type from its fields. Nothing is downloaded: ``transformers`` only
reads local files. ``model.pretrained=true`` starts from ``DIR``'s safetensors weights, which are read into the
parallelised model's shards (``disttrain.parallel.pretrained``). A value ``transformers`` would reject is one
ConfigError naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from disttrain.data.spec import DataSpec
from disttrain.errors import ConfigError
from disttrain.models.hf import balance as hf_balance
from disttrain.models.lora import LoRAConfig
from disttrain.quiet_imports import transformers_with_models
from disttrain.safetensors_reader import ConfigRefusal, SafetensorsFolder

CONFIG_FILE = "config.json"
"""The architecture file of a Hugging Face model folder."""


@dataclass
class HFConfig:
    """A ``transformers`` causal language model, built from a local folder's config or from a model type."""

    name: str = "hf"
    """Registry name of this model."""
    path: str | None = None
    """A local folder with the model's ``config.json`` (and, for ``pretrained``, its safetensors weights)."""
    arch: str | None = None
    """A ``transformers`` model type (llama, qwen3, mistral, gpt2, ...) built from its defaults and ``fields``,
    instead of a folder."""
    pretrained: bool = False
    """Start from the folder's safetensors weights instead of a seeded random initialisation (needs ``path``)."""
    init_weights: str | None = None
    """A safetensors file of this model's ``state_dict()`` to start from instead of the seeded initialisation
    (``disttrain.checkpoint.init_weights``); not a ``resume``: step 0, a fresh optimiser. None: the seeded init."""
    attn_implementation: str | None = None
    """How the model attends, as ``transformers`` names it: ``sdpa`` (PyTorch's fused scaled dot-product
    attention), ``eager`` (its own matmul and softmax, which families such as Gemma2 need for their softcapping)
    or ``flex_attention`` (torch's flex attention, on a GPU), where the model class has it. None: sdpa where the
    class has it, else eager (with a notice)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """Fields of the architecture's config set here (``+model.hidden_size=256``), over the folder's or the type's
    defaults; ``vocab_size`` defaults to the data's vocabulary when a type is built from scratch."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters through PEFT (``model.lora.rank=16``), the rest of the model frozen; off by default
    (``disttrain.models.lora``)."""

    OPEN_FIELDS = "fields"
    """Keys of the model node that are not fields of this schema are gathered into this one."""

    def validate(self, spec: DataSpec) -> Any:
        """The ``transformers`` config this describes for the text of ``spec``; ConfigError where it cannot be."""
        transformers = _transformers()
        if spec.kind != "text":
            raise ConfigError("model.name", self.name, "a model for text data (a causal language model); data "
                              f"{spec.kind!r} is not text")
        if (self.path is None) == (self.arch is None):
            raise ConfigError("model.path", self.path, "a folder with config.json, or null with model.arch set "
                              "(exactly one of model.path and model.arch)")
        if self.pretrained and self.path is None:
            raise ConfigError("model.pretrained", True, "false unless model.path names a folder with weights")
        fields = dict(self.fields)
        if self.arch is not None and "vocab_size" not in fields:
            fields["vocab_size"] = spec.vocab_size
        config = self._config(transformers, {})
        defaults = type(config)()
        for key, value in self.fields.items():
            if not hasattr(defaults, key):
                raise ConfigError(f"model.{key}", value, f"a field of {type(config).__name__} (it has none of "
                                  "that name)")
        # built with its fields, not set afterwards: a config derives some fields from others (layer types)
        config = self._config(transformers, fields)
        _check_fits(config, spec)
        if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
            raise ConfigError("model.arch" if self.arch else "model.path", self.arch or self.path,
                              f"a causal language model; transformers has none for {type(config).__name__}")
        _check_token_ids(config)
        self.attention(config)
        refusal = getattr(config, "output_router_logits", False) and hf_balance.balance_loss_refusal(
            config, transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)])
        if refusal:
            raise ConfigError("model.output_router_logits", True, refusal)
        starting_weights = self.pretrained_folder()
        if starting_weights is not None:
            starting_weights.files()  # the headers are checked against the model built on the meta device
        return config

    def pretrained_folder(self) -> SafetensorsFolder | None:
        """The folder whose safetensors weights the model starts from (``model.pretrained=true``), refused as a
        ConfigError on ``model.path``; None for a seeded random initialisation."""
        if not self.pretrained:
            return None
        return SafetensorsFolder(Path(self.path).expanduser(), ConfigRefusal(
            "model.path", self.path, "a folder of this model's safetensors weights"))

    def attention(self, config: Any) -> tuple[str, str | None]:
        """The attention implementation the model of ``config`` is built with, and a notice where none was asked
        for and its class has no SDPA; ConfigError for one its class lacks."""
        transformers = _transformers()
        model_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        allowed = attention_implementations(model_class)
        if self.attn_implementation is None:
            if "sdpa" in allowed:
                return "sdpa", None
            others = [name for name in allowed if name != "eager"]
            return "eager", (f"model.attn_implementation=eager: {model_class.__name__} has no SDPA attention in "
                             "transformers" + (f" (it also takes {', '.join(others)})" if others else ""))
        if self.attn_implementation not in allowed:
            no_gpu = self.attn_implementation == "flex_attention" and getattr(model_class, "_supports_flex_attn",
                                                                               False)
            raise ConfigError("model.attn_implementation", self.attn_implementation,
                              f"one of {', '.join(allowed)} for {model_class.__name__}" + (
                                  " (flex_attention needs a GPU here: torch's flex attention computes no gradients "
                                  "on the CPU)" if no_gpu else ""))
        return self.attn_implementation, None

    def notices(self, spec: DataSpec) -> list[str]:
        """What validation decided for the user: the attention chosen where it is not sdpa and none was named."""
        notice = self.attention(self.validate(spec))[1]
        return [notice] if notice else []

    def _config(self, transformers: Any, fields: dict[str, Any]) -> Any:
        if self.arch is not None:
            if self.arch not in transformers.CONFIG_MAPPING:
                raise ConfigError("model.arch", self.arch, f"a transformers model type; {_known_types(self.arch)}")
            return self._built_config(transformers, self.arch, fields, "fields its config accepts")
        folder = Path(self.path).expanduser()
        if not (folder / CONFIG_FILE).is_file():
            raise ConfigError("model.path", self.path, f"a folder with {CONFIG_FILE} (there is no "
                              f"{folder / CONFIG_FILE})")
        try:
            saved, _ = transformers.PretrainedConfig.get_config_dict(str(folder), local_files_only=True)
        except (ValueError, OSError) as err:
            raise ConfigError("model.path", self.path, f"a {CONFIG_FILE} that transformers reads ({err})") from None
        saved = {**saved, **fields}
        model_type = saved.pop("model_type", None)
        if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
            found = "it names none" if model_type is None else f"{model_type!r} is not one"
            raise ConfigError("model.path", self.path, f"a {CONFIG_FILE} whose model_type transformers knows; "
                              f"{found} ({_known_types(str(model_type or ''))})")
        return self._built_config(transformers, model_type, saved, f"a {CONFIG_FILE} that transformers reads")

    def _built_config(self, transformers: Any, model_type: str, values: dict[str, Any], allowed: str) -> Any:
        """``transformers``' config of ``model_type`` with ``values``; what it rejects as one line naming the field
        where ``transformers`` names one (a value of the wrong type), else the folder or type with its reason."""
        from huggingface_hub.errors import StrictDataclassError, StrictDataclassFieldValidationError

        try:
            return transformers.AutoConfig.for_model(model_type, **values)
        except StrictDataclassFieldValidationError as err:
            named = re.match(r"Validation error for field '(\w+)'", str(err))
            if named and named.group(1) in values:
                raise ConfigError(f"model.{named.group(1)}", values[named.group(1)],
                                  f"a value {model_type}'s config accepts ({one_line(err.__cause__ or err)})"
                                  ) from None
            raise ConfigError("model.arch" if self.arch else "model.path", self.arch or self.path,
                              f"{allowed} ({one_line(err)})") from None
        except (StrictDataclassError, ValueError, KeyError, TypeError) as err:
            raise ConfigError("model.arch" if self.arch else "model.path", self.arch or self.path,
                              f"{allowed} ({one_line(err.__cause__ or err)})") from None


def one_line(err: BaseException) -> str:
    """An exception as one line: its type and message, line breaks folded."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def _transformers() -> Any:
    try:
        return transformers_with_models()
    except ImportError:
        raise ConfigError("model.name", "hf", "a built-in model unless transformers is installed "
                          "(pip install 'disttrain[hf]')") from None


def _known_types(model_type: str) -> str:
    """The few ``transformers`` model types spelled like ``model_type``, and how to list them all (transformers
    knows hundreds: a message listing every one runs to several KB)."""
    from difflib import get_close_matches

    import transformers

    known = list(transformers.CONFIG_MAPPING)
    close = get_close_matches(model_type, known, n=4)
    sample = f"close to it: {', '.join(close)}" if close else "e.g. llama, qwen3, mistral, gpt2"
    return (f"{sample}; all {len(known)}: python -c 'import transformers; "
            "print(sorted(transformers.CONFIG_MAPPING))'")


def attention_implementations(model_class: type) -> list[str]:
    """The attention implementations of ``transformers``' ``model_class`` that disttrain builds and trains with
    here: its own eager attention always, SDPA and flex attention where the class declares them (flex where a
    GPU computes its gradients)."""
    allowed = ["sdpa"] if getattr(model_class, "_supports_sdpa", False) else []
    allowed.append("eager")
    if getattr(model_class, "_supports_flex_attn", False) and torch.cuda.is_available():
        allowed.append("flex_attention")
    return allowed


def _check_token_ids(config: Any) -> None:
    """The padding token, which the model's embedding holds a row for, is one of its vocabulary's (transformers
    asserts it when it builds the embedding)."""
    vocab = getattr(config, "vocab_size", None)
    pad = getattr(config, "pad_token_id", None)
    if vocab is not None and isinstance(pad, int) and not 0 <= pad < vocab:
        raise ConfigError("model.pad_token_id", pad, f"null (+model.pad_token_id=null) or a token id below the "
                          f"model's vocab_size {vocab}: the embedding keeps a row for it")


def _check_fits(config: Any, spec: DataSpec) -> None:
    """The model's vocabulary holds the data's tokens and its positions the data's windows."""
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and vocab < spec.vocab_size:
        raise ConfigError("model.vocab_size", vocab, f"at least the data's vocabulary of {spec.vocab_size} tokens")
    for key in ("max_position_embeddings", "n_positions"):
        positions = getattr(config, key, None)
        if positions is not None and positions < spec.block_size:
            raise ConfigError(f"model.{key}", positions, f"at least the data's block size of {spec.block_size}")
