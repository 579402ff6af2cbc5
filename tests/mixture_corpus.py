"""Three sources for ``data=mixture`` tests, written by the test itself: Parquet, JSON lines and a folder saved by
``datasets``, each document a documentation topic tagged with its source and number."""

from __future__ import annotations

import json
from pathlib import Path

from tests.test_text_data import make_tokenizer, topic_texts


def source_texts() -> dict[str, list[str]]:
    """The documents of each source, in order: short stretches of documentation topics of varied length."""
    texts = topic_texts()[20:]
    return {kind: [texts[(7 * number + offset) % len(texts)][: 60 + 37 * (number % 9)]
                   for number in range(count)]
            for kind, offset, count in (("parquet", 0, 40), ("jsonl", 3, 30), ("saved", 5, 25))}


def write_sources(folder: Path) -> dict[str, Path]:
    """The three sources under ``folder`` (the Parquet file in two row groups); their paths by kind."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = source_texts()
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"parquet": folder / "web.parquet", "jsonl": folder / "code.jsonl", "saved": folder / "books"}
    table = pa.table({"id": list(range(len(texts["parquet"]))), "text": texts["parquet"]})
    pq.write_table(table, paths["parquet"], row_group_size=16)
    with open(paths["jsonl"], "w", encoding="utf-8") as handle:
        for number, text in enumerate(texts["jsonl"]):
            handle.write(json.dumps({"id": number, "content": text}) + "\n")
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": texts["saved"]}).save_to_disk(str(paths["saved"]))
    return paths


def mixture_overrides(folder: Path) -> list[str]:
    """Config overrides for a mixture of the three sources (weights 3, 2, 1) and a small tokenizer."""
    paths = write_sources(folder / "sources")
    tokenizer = make_tokenizer(folder / "tok")
    sources = (f"[{{path: {paths['parquet']}, weight: 3}}, {{path: {paths['jsonl']}, weight: 2, field: content}}, "
               f"{{path: {paths['saved']}, weight: 1}}]")
    return ["data=mixture", f"data.sources={sources}", f"data.tokenizer={tokenizer}", "data.val_documents=4"]
