"""Export a sharded checkpoint to one consolidated weights file, or to a Hugging Face model folder.

    python -m disttrain.checkpoint.export RUN_DIR/checkpoints/last.ckpt model.pt
    python -m disttrain.checkpoint.export RUN_DIR --format safetensors model.safetensors
    python -m disttrain.checkpoint.export RUN_DIR --format hf OUT_DIR
    python -m disttrain.checkpoint.export RUN_DIR --format peft OUT_DIR

A run directory stands for its ``checkpoints/last.ckpt``. The default format writes only the model's tensors
(names as in the bare model, e.g. ``embed.wte.weight``), which load with ``torch.load(path, weights_only=True)``
into a model built from the run's ``config.yaml`` (without ``model.lora`` for a LoRA run: below).
``--format safetensors`` writes the same tensors under the same names as one safetensors file, the field's
exchange format and what ``model.init_weights`` starts a run from (``disttrain.checkpoint.init_weights``).
``--format hf`` (models ``llama`` and ``hf``) writes ``config.json``, ``generation_config.json``, safetensors
weights and the run's tokenizer files, a folder that ``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)``
loads and generates from; it reads the run's ``config.yaml`` from the run directory (two levels above a checkpoint
folder). ``--format peft`` (``hf`` models with ``model.lora``) writes the adapters alone, a folder
``peft.PeftModel.from_pretrained`` loads on the base model (``disttrain.checkpoint.adapters``).

A run trained with LoRA adapters (``model.lora``) is exported as one model in every weights format: each adapter
merged into the weight it wraps (``W + scale * B A``, PEFT's own merge on the model the run's ``config.yaml``
describes), under the names of the model without adapters. That is what a reader of a weights file takes it for:
the trained model, which ``model.init_weights`` starts a next run from (without ``model.lora``, or with new
adapters on the merged base: the file's names are the base model's either way), which ``torch.load`` fills a
model built without adapters with, and which ``--format hf`` writes. A file that kept the adapters' own names
would fit only the model with these very adapters: ``model.init_weights`` refuses it, and the run's own
checkpoint already holds it. ``--keep-adapters`` writes it all the same (adapters under their own names, each
wrapped weight as ``<module>.base_layer.weight``: what ``torch.load`` fills the model built from the run's
``config.yaml`` with); ``--format peft`` writes the adapters alone. A base held in bf16 or nf4
(``model.lora.base_dtype``; a checkpoint holds nf4's 4-bit codes dequantised, in bf16) is merged in bf16: the
merged weights are the dequantised base plus the adapters, rounded to bf16, and a next run reads them into its
own dtype.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from disttrain.checkpoint.atomic import write_atomically
from disttrain.checkpoint.io import CheckpointReadError
from disttrain.errors import ConfigError

TASK_PREFIX = "net."


def consolidated_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Read every rank's shard of the model from a checkpoint folder, in one process, as full tensors (through
    the checkpoint reader: a stored object that is not plain data is refused, never run)."""
    from disttrain.checkpoint.io import load_index, load_items

    if not (checkpoint / ".metadata").is_file():
        raise FileNotFoundError(f"{checkpoint} is not a sharded checkpoint folder (no .metadata inside)")
    index = load_index(checkpoint)
    # replicas that differ (Local SGD, DiLoCo, an asynchronous parameter server) are kept each: take the first
    replicas = any(key.startswith("replica0.") for key in index.state_dict_metadata)
    top = ("replica0", "state_dict") if replicas else ("state_dict",)
    items = load_items(checkpoint, lambda path: path[:len(top)] == top, index)
    weights = {".".join(map(str, path[len(top):])).removeprefix(TASK_PREFIX): value for path, value in items.items()}
    return {key: value.contiguous() if isinstance(value, torch.Tensor) else value for key, value in weights.items()}


def exported_weights(source: Path, merge_adapters: bool = True) -> dict[str, Any]:
    """The consolidated weights of the checkpoint that ``source`` names (a run directory or a checkpoint
    folder), a LoRA run's adapters merged into the weights they wrap unless ``merge_adapters`` is false (the
    run's ``config.yaml``, which a merge builds the model from, is read only then); FileNotFoundError where a
    merge finds no ``config.yaml`` in the run directory."""
    from disttrain.models.lora import holds_adapters

    checkpoint, run_dir = checkpoint_and_run_dir(source)
    weights = consolidated_weights(checkpoint)
    if not (merge_adapters and holds_adapters(weights)):
        return weights
    from disttrain.checkpoint.run_model import merged_model, run_config

    cfg = run_config(checkpoint, run_dir, "a LoRA checkpoint's adapters are merged on the model the run's config "
                     "describes (--keep-adapters writes them unmerged)")
    return merged_model(cfg, weights).weights


def export(source: Path, output: Path, merge_adapters: bool = True) -> Path:
    """Write the consolidated weights of the checkpoint that ``source`` names (``exported_weights``) to
    ``output`` with ``torch.save`` (written beside it, then renamed)."""
    weights = exported_weights(source, merge_adapters)
    return write_atomically(output, lambda staging: torch.save(weights, staging))


def export_safetensors(source: Path, output: Path, merge_adapters: bool = True) -> Path:
    """Write the consolidated weights of the checkpoint that ``source`` names (``exported_weights``) to
    ``output`` as one safetensors file, under the names ``export`` writes (written beside it, then renamed);
    ConfigError for a checkpoint whose model state holds something other than tensors, which safetensors cannot
    hold."""
    from safetensors.torch import save_file

    tensors = safetensors_tensors(exported_weights(source, merge_adapters))
    return write_atomically(output, lambda staging: save_file(tensors, str(staging), metadata={"format": "pt"}))


def safetensors_tensors(weights: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``weights`` as safetensors writes them: contiguous tensors of their own memory each. A tensor that shares
    its memory with one before it (tied weights, views of one buffer), which safetensors refuses, is written as a
    copy under its own name, so the file keeps every name (a tied pair holds equal values, as ``model.init_weights``
    requires). ConfigError naming the first value that is no tensor."""
    tensors: dict[str, torch.Tensor] = {}
    memory_seen: set[int] = set()
    for name, value in weights.items():
        if not isinstance(value, torch.Tensor):
            raise ConfigError("--format", "safetensors", f"pt for this checkpoint: its model state holds {name} as "
                              f"{type(value).__name__}, and a safetensors file holds tensors only")
        memory = value.untyped_storage().data_ptr()
        tensors[name] = value.clone(memory_format=torch.contiguous_format) if memory in memory_seen else \
            value.contiguous()
        memory_seen.add(memory)
    return tensors


def checkpoint_and_run_dir(source: Path) -> tuple[Path, Path]:
    """The checkpoint folder and run directory that ``source`` names: a run directory (its
    ``checkpoints/last.ckpt``) or a checkpoint folder (its run directory two levels up)."""
    if (source / "config.yaml").is_file() and not (source / ".metadata").is_file():
        return source / "checkpoints" / "last.ckpt", source
    return source, source.parent.parent


def export_hf(source: Path, output: Path, max_shard_size: int | str = "5GB") -> Path:
    """Write the checkpoint that ``source`` names (a run directory or a checkpoint folder) as a Hugging Face model
    folder ``output``, with the tokenizer files of the run's ``data.tokenizer`` where it had one; ConfigError for
    a model without a Hugging Face format or a tokenizer folder that is not one."""
    from disttrain.checkpoint.hf import check_hf_model, hf_folder, run_tokenizer, tokenizer_files, write_hf_folder
    from disttrain.checkpoint.run_model import run_config

    checkpoint, run_dir = checkpoint_and_run_dir(source)
    cfg = run_config(checkpoint, run_dir)
    check_hf_model(cfg)  # before reading any weights
    tokenizer = run_tokenizer(cfg)
    tokenizer_data = tokenizer_files(tokenizer) if tokenizer else None
    config, weights = hf_folder(consolidated_weights(checkpoint), cfg)
    return write_hf_folder(config, weights, output, max_shard_size, tokenizer_data)


def export_peft(source: Path, output: Path) -> Path:
    """Write the LoRA adapters of the checkpoint that ``source`` names (a run directory or a checkpoint folder) as
    a PEFT adapter folder ``output`` (``disttrain.checkpoint.adapters``)."""
    from disttrain.checkpoint.adapters import write_peft_folder
    from disttrain.checkpoint.run_model import run_config

    checkpoint, run_dir = checkpoint_and_run_dir(source)
    return write_peft_folder(run_config(checkpoint, run_dir), consolidated_weights(checkpoint), output)


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a run directory, or a checkpoint folder such as "
                                                  "RUN/checkpoints/last.ckpt")
    parser.add_argument("output", type=Path, help="the weights file (pt, safetensors) or the model folder (hf, "
                                                  "peft) to write")
    parser.add_argument("--format", choices=("pt", "safetensors", "hf", "peft"), default="pt",
                        help="pt: one torch weights file (default); safetensors: the same tensors as one "
                             "safetensors file (what model.init_weights reads), both with a LoRA run's adapters "
                             "merged; hf: a Hugging Face model folder (adapters merged); peft: a LoRA run's "
                             "adapters alone, as PEFT saves them")
    parser.add_argument("--keep-adapters", action="store_true",
                        help="pt, safetensors: write a LoRA run's adapters under their own names beside the weights "
                             "they wrap, as the run holds them, instead of merged into those weights (the default)")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="hf: weights above this size are split into shards with an index (default 5GB)")
    args = parser.parse_args()
    try:
        if args.format in ("hf", "peft"):
            path = export_hf(args.source, args.output, args.max_shard_size) if args.format == "hf" else \
                export_peft(args.source, args.output)
            size = sum(f.stat().st_size for f in path.iterdir())
        else:
            write = export_safetensors if args.format == "safetensors" else export
            path = write(args.source, args.output, merge_adapters=not args.keep_adapters)
            size = path.stat().st_size
    except (ConfigError, FileNotFoundError, CheckpointReadError) as err:
        # what a user gave or what a file holds: one line, the status of every refused input (2)
        print(f"Error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(f"wrote {path} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
