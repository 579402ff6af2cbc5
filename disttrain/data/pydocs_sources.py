"""Python's own documentation split into three mixture sources and a tokenizer, written locally (no download).

``python -m disttrain.data.pydocs_sources [FOLDER]`` writes, under FOLDER (default ``data/pydocs_mixture``), the
topics dealt into ``reference.parquet`` (in several row groups), ``library.jsonl`` (one topic per line under
``text``) and ``other/*.txt`` (one topic per file), and ``tokenizer/``
(a byte-level BPE tokenizer trained on the topics, with ``<|endoftext|>``). The ``recipe=gpt_pydocs_mixture``
and the data page's mixture command read them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DEFAULT_FOLDER = "data/pydocs_mixture"
"""Where the sources are written when no folder is named (the recipe reads them there)."""
END_OF_TEXT = "<|endoftext|>"
"""The tokenizer's end-of-document token."""
VOCAB_SIZE = 1024
"""The tokenizer's vocabulary, its end token included."""


def topics() -> list[tuple[str, str]]:
    """``(key, text)`` of every documentation topic, sorted by key."""
    from pydoc_data.topics import topics as texts

    return [(key, texts[key]) for key in sorted(texts)]


def split_topics() -> dict[str, list[str]]:
    """The topics dealt in key order into three sources, as cards are dealt: topic ``i`` to source ``i % 3``."""
    texts = [text for _, text in topics()]
    return {"reference": texts[0::3], "library": texts[1::3], "other": texts[2::3]}


def write_pydocs_sources(folder: str | Path = DEFAULT_FOLDER) -> dict[str, Path]:
    """Write the three sources and the tokenizer under ``folder``; their paths by name."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(folder)
    sources = split_topics()
    (folder / "other").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": sources["reference"]}), folder / "reference.parquet", row_group_size=16)
    with open(folder / "library.jsonl", "w", encoding="utf-8") as handle:
        for text in sources["library"]:
            handle.write(json.dumps({"text": text}) + "\n")
    for number, text in enumerate(sources["other"]):
        (folder / "other" / f"{number:04d}.txt").write_text(text, encoding="utf-8")
    return {"reference": folder / "reference.parquet", "library": folder / "library.jsonl",
            "other": folder / "other", "tokenizer": write_tokenizer(folder / "tokenizer")}


def write_tokenizer(folder: Path, vocab_size: int = VOCAB_SIZE) -> Path:
    """A byte-level BPE tokenizer trained on the topics, saved as ``folder/tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((text for _, text in topics()), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def main(argv: list[str]) -> None:
    """Write the sources into the folder named by ``argv`` (or the default) and print where they are."""
    folder = argv[0] if argv else DEFAULT_FOLDER
    paths = write_pydocs_sources(folder)
    print(f"wrote {', '.join(str(path) for path in paths.values())}")


if __name__ == "__main__":
    main(sys.argv[1:])
