"""``python -m disttrain.generate RUN_DIR --prompt "def "``: text that a finished run's model writes after a
prompt, from its best checkpoint (where the run ranked one) or its last.

Byte-level text data (``data=pydocs``) reads the prompt as UTF-8 bytes; data with a ``tokenizer`` folder uses
its ``tokenizer.json``. The context is the data's block size: a longer prompt is cropped to its last tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from disttrain.errors import ConfigError


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, its numbers checked (ConfigError naming the option)."""
    parser = argparse.ArgumentParser(prog="python -m disttrain.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a finished run's directory")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--checkpoint", default=None,
                        help="best, last or a checkpoint folder (default: best where the run ranked one, else last)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default 200)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="softmax temperature; 0 is greedy (default 0.8)")
    parser.add_argument("--top-k", type=int, default=50,
                        help="sample among the k likeliest tokens; 0: all (default 50)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampling (default: unseeded)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model runs (default cpu)")
    args = parser.parse_args(argv)
    for option, value in (("--max-new-tokens", args.max_new_tokens), ("--temperature", args.temperature),
                          ("--top-k", args.top_k)):
        if value < 0:
            raise ConfigError(option, value, "0 or more")
    return args


def generate(args: argparse.Namespace) -> str:
    """The prompt and what the run's model writes after it."""
    import torch

    from disttrain.generate.loading import load_run
    from disttrain.generate.sampling import sample

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", args.device, "cpu: no CUDA device is available here")
    loaded = load_run(args.run_dir, args.checkpoint, args.device)
    prompt = loaded.codec.encode(args.prompt)
    if not prompt:
        raise ConfigError("--prompt", args.prompt, "text of at least one token")
    generator = None
    if args.seed is not None:
        generator = torch.Generator(device=args.device).manual_seed(args.seed)
    tokens = sample(loaded.model, prompt, args.max_new_tokens, loaded.spec.block_size, args.temperature,
                    args.top_k, loaded.spec.vocab_size, generator)
    return loaded.codec.decode(tokens)


def main(argv: list[str] | None = None) -> None:
    """Print the generated text; a bad input (an option, or a checkpoint that cannot be read or is refused) is
    one ``Error:`` line and exit status 2."""
    try:
        args = parse(argv)
    except ConfigError as err:
        refuse(err)
    from disttrain.checkpoint.io import CheckpointReadError  # imports torch: after ``--help`` and the options

    try:
        text = generate(args)
    except (ConfigError, CheckpointReadError) as err:
        refuse(err)
    print(text)


def refuse(err: Exception) -> NoReturn:
    """Print ``err`` as one ``Error:`` line and exit with status 2."""
    print(f"Error: {err}", file=sys.stderr, flush=True)
    sys.exit(2)


if __name__ == "__main__":
    main()
