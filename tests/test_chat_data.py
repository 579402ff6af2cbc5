"""``data=chat``: conversations formatted with the tokenizer's chat template, the loss on the assistant's tokens only.

The tokenizer is built here (a byte-level BPE trained on Python's docs, as ``test_text_data`` makes one) with a chat
template that marks the assistant's turns with ``{% generation %}``, so ``transformers`` computes the assistant mask
its own way (``return_assistant_tokens_mask``) and the data's mask, found prefix by prefix, is checked against it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from disttrain.data import ChatConfig, build_datamodule  # noqa: E402
from disttrain.data.base import IGNORE_INDEX  # noqa: E402
from disttrain.data.chat_format import PLAIN_CHAT_TEMPLATE, load_chat_tokenizer, tokenize_conversation  # noqa: E402
from disttrain.data.position import epoch_position  # noqa: E402
from disttrain.errors import ConfigError  # noqa: E402
from disttrain.loss import token_cross_entropy  # noqa: E402
from tests.conftest import attach  # noqa: E402
from tests.test_text_data import EOS, make_tokenizer  # noqa: E402

TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
            "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>\n' }}{% endgeneration %}"
            "{% else %}{{ m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
"""ChatML, as Qwen's templates write it, with the assistant's turns marked for ``transformers``' own mask."""


def make_chat_tokenizer(folder: Path, template: str | None = TEMPLATE) -> Path:
    """A tokenizer folder (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja`` unless
    ``template`` is None) with ChatML's two special tokens."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    make_tokenizer(folder)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(folder / "tokenizer.json")),
                                        eos_token=EOS)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return folder


def conversations(count: int) -> list[dict]:
    """Rows of both forms, each with its number in the prompt (so a sample says which row it is): multi-turn
    conversations with a system message, and prompt/response pairs."""
    rows = []
    for k in range(count):
        if k % 2:
            rows.append({"prompt": f"Question {k}: what is {k} + {k}?", "response": f"It is {2 * k}."})
        else:
            rows.append({"messages": [{"role": "system", "content": "Answer briefly."},
                                      {"role": "user", "content": f"Question {k}: name a colour."},
                                      {"role": "assistant", "content": "Blue."},
                                      {"role": "user", "content": "Another?"},
                                      {"role": "assistant", "content": f"Red, number {k}."}]})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def messages_of(row: dict) -> list[dict]:
    """A row as the conversation ``transformers`` is handed."""
    return row.get("messages") or [{"role": "user", "content": row["prompt"]},
                                   {"role": "assistant", "content": row["response"]}]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> Path:
    return make_chat_tokenizer(tmp_path_factory.mktemp("chat") / "tok")


def chat_data(tmp_path: Path, tokenizer: Path, rows: list[dict], micro: int = 4, **options):
    """The built data module of ``rows`` (validated first, as the job does)."""
    cfg = ChatConfig(files=[str(write_jsonl(tmp_path / "chat.jsonl", rows))], tokenizer=str(tokenizer),
                     **{"block_size": 128, **options})
    notices = cfg.validate()
    return build_datamodule(cfg, micro_batch_size=micro, seed=0), notices


def test_the_assistant_tokens_are_those_transformers_marks(chat_tokenizer):
    """Found prefix by prefix, the ids and the mask equal ``apply_chat_template``'s with
    ``return_assistant_tokens_mask`` (the template marks every assistant turn, its closing tokens included)."""
    tokenizer = load_chat_tokenizer(str(chat_tokenizer))
    for row in conversations(4):
        messages = messages_of(row)
        ids, mask = tokenize_conversation(tokenizer, messages, "row")
        theirs = tokenizer.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
        assert ids.tolist() == theirs["input_ids"]
        assert mask.astype(int).tolist() == theirs["assistant_masks"]
        assert 0 < mask.sum() < len(mask)


def test_the_loss_on_a_batch_is_transformers_own_with_the_same_mask(tmp_path, chat_tokenizer):
    """The task's cross-entropy of a tiny Llama on a batch of padded rows equals ``LlamaForCausalLM``'s own loss
    on the same conversations, given ``transformers``' assistant mask as labels (-100 elsewhere) and an attention
    mask over its own right padding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from disttrain.rank.task import TrainTask

    rows = conversations(12)
    datamodule, _ = chat_data(tmp_path, chat_tokenizer, rows)
    inputs, targets = datamodule.datasets["train"].get_batch([0, 1, 2, 3])
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=datamodule.spec.vocab_size, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=128)).eval()
    task = TrainTask(model, datamodule.spec, None, None, total_steps=1)
    ours, _ = task._loss((inputs, targets))

    tokenizer = load_chat_tokenizer(str(chat_tokenizer))
    encoded = [tokenizer.apply_chat_template(messages_of(row), return_assistant_tokens_mask=True, return_dict=True)
               for row in rows[:4]]
    length = max(len(e["input_ids"]) for e in encoded)
    ids = torch.zeros(4, length, dtype=torch.long)
    labels = torch.full((4, length), -100)
    attention = torch.zeros(4, length, dtype=torch.long)
    for k, e in enumerate(encoded):
        n = len(e["input_ids"])
        ids[k, :n] = torch.tensor(e["input_ids"])
        labels[k, :n] = torch.where(torch.tensor(e["assistant_masks"]).bool(), ids[k, :n], -100)
        attention[k, :n] = 1
    theirs = model(input_ids=ids, attention_mask=attention, labels=labels).loss
    assert (targets != IGNORE_INDEX).sum() == (labels[:, 1:] != -100).sum()
    # measured: 0 to 2.4e-7 apart (fp32); a target one token off, or the prompt's tokens in the loss, moves it by 0.1
    assert abs(ours.item() - theirs.item()) < 1e-6, (ours.item(), theirs.item())


def test_the_prompt_tokens_carry_no_gradient(tmp_path, chat_tokenizer):
    """The loss's gradient w.r.t. the logits is exactly zero at every position whose next token is the prompt's
    (by ``transformers``' own assistant mask) or padding, and nonzero at every position whose next token is the
    assistant's. (The prompt's embeddings do get a gradient: the assistant's predictions attend to them.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    rows = conversations(12)
    datamodule, _ = chat_data(tmp_path, chat_tokenizer, rows)
    inputs, targets = datamodule.datasets["train"].get_batch([0, 1, 2, 3])
    tokenizer = load_chat_tokenizer(str(chat_tokenizer))
    next_is_assistant = torch.zeros_like(targets, dtype=torch.bool)
    for k, row in enumerate(rows[:4]):
        mask = tokenizer.apply_chat_template(messages_of(row), return_assistant_tokens_mask=True,
                                             return_dict=True)["assistant_masks"]
        next_is_assistant[k, :len(mask) - 1] = torch.tensor(mask[1:]).bool()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=datamodule.spec.vocab_size, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=128))
    logits = model(inputs).logits
    logits.retain_grad()
    token_cross_entropy(logits, targets).backward()
    per_position = logits.grad.abs().amax(dim=-1)
    assert next_is_assistant.any() and (~next_is_assistant).any()
    assert torch.all(per_position[~next_is_assistant] == 0)
    assert torch.all(per_position[next_is_assistant] > 0)


def test_rows_longer_than_the_window_are_truncated_or_dropped_and_counted(tmp_path, chat_tokenizer):
    rows = conversations(12)
    for k in (0, 4):  # two conversations far longer than any window here
        rows[k]["messages"][-1]["content"] = "word " * 200
    truncated, notices = chat_data(tmp_path / "t", chat_tokenizer, rows)
    assert truncated.report()["truncated"] == 2 and truncated.report()["rows"] == 12
    assert "2 longer than data.block_size + 1 = 129 tokens (2 truncated, 0 dropped" in notices[0]
    inputs, targets = truncated.datasets["train"].get_batch([0, 4])
    assert (targets[:, -1] != IGNORE_INDEX).all()  # the cut row fills the window to its last target

    dropped, notices = chat_data(tmp_path / "d", chat_tokenizer, rows, too_long="drop")
    assert dropped.report()["dropped_too_long"] == 2 and dropped.report()["rows"] == 10
    assert "(0 truncated, 2 dropped: data.too_long=drop)" in notices[0]

    for k in (1, 3):  # cut inside the prompt: no assistant token is left to predict, so the row is dropped
        rows[k]["prompt"] = "word " * 200
    short, notices = chat_data(tmp_path / "s", chat_tokenizer, rows)
    assert short.report()["dropped_no_target"] == 2 and short.report()["truncated"] == 2
    assert short.report()["rows"] == 10
    assert "dropped with no assistant token inside the window" in notices[0]


def test_parquet_rows_are_the_jsonl_rows(tmp_path, chat_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = conversations(12)
    jsonl, _ = chat_data(tmp_path / "j", chat_tokenizer, rows)
    path = tmp_path / "p" / "chat.parquet"
    path.parent.mkdir()
    # both forms in one table: each row's other columns are null; several row groups, read a batch at a time
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    schema = pa.schema([("messages", pa.list_(message)), ("prompt", pa.string()), ("response", pa.string())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=5)
    cfg = ChatConfig(files=[str(path)], tokenizer=str(chat_tokenizer), block_size=128)
    cfg.validate()
    parquet = build_datamodule(cfg, micro_batch_size=4, seed=0)
    for split in ("train", "val"):
        ours, theirs = jsonl.datasets[split], parquet.datasets[split]
        assert len(ours) == len(theirs)
        for k in range(len(ours)):
            assert all(torch.equal(a, b) for a, b in zip(ours[k], theirs[k], strict=True))


def test_a_tokenizer_without_a_chat_template_writes_the_plain_one(tmp_path):
    folder = make_chat_tokenizer(tmp_path / "tok", template=None)
    tokenizer = load_chat_tokenizer(str(folder))
    assert tokenizer.chat_template == PLAIN_CHAT_TEMPLATE
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == f"<|user|>\nHi\n<|assistant|>\nHello.{EOS}\n"
    ids, mask = tokenize_conversation(tokenizer, messages, "row")
    learned = tokenizer.decode(ids[mask].tolist())
    assert learned == f"Hello.{EOS}\n"


def read_rows(datamodule, ranks: int, micro: int, accumulation: int, state: dict | None) -> list[list[int]]:
    """Each rank's rows (by the number in their prompt) in epoch 0 under this layout, after resuming from
    ``state``."""
    dataset = datamodule.datasets["train"]
    number = {tuple(dataset[k][0].tolist()): k for k in range(len(dataset))}
    out = []
    for rank in range(ranks):
        attach(datamodule, ranks, rank)
        datamodule.micro_batch_size, datamodule.accumulation = micro, accumulation
        datamodule.load_state_dict(state or {})
        loader = datamodule.train_dataloader()
        loader.sampler.set_epoch(0)
        out.append([number[tuple(row.tolist())] for inputs, _ in loader for row in inputs])
    return out


@pytest.mark.parametrize(("before", "after"), [((2, 2, 1), (1, 2, 2)), ((1, 2, 2), (4, 1, 1))])
def test_a_resumed_epoch_reads_the_remaining_rows_on_any_data_parallel_size(tmp_path, chat_tokenizer, before, after):
    """Global batch 4, 2 steps done, then the rest of the epoch on another layout: every row exactly once, and
    in the global order one process reads them."""
    datamodule, _ = chat_data(tmp_path, chat_tokenizer, conversations(18), val_fraction=0.1)
    assert len(datamodule.datasets["train"]) == 17  # an epoch of 4 whole steps of 4: one row left over
    ranks, micro, accumulation = before
    first = [seen[:2 * micro * accumulation] for seen in read_rows(datamodule, *before, None)]
    rest = read_rows(datamodule, *after, epoch_position(0, 2 * accumulation, micro, accumulation, ranks))
    seen = sorted(k for rows in [*first, *rest] for k in rows)
    whole = read_rows(datamodule, 1, 4, 1, None)[0]
    assert seen == sorted(whole) and len(seen) == 16 == len(set(seen))


def _missing_file(tmp_path: Path, path: Path) -> dict:
    return {"files": [str(path), str(tmp_path / "nope.jsonl")]}


def _row_without_fields(tmp_path: Path, path: Path) -> dict:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"question": "no known field"}) + "\n")
    return {}


def _unknown_role(tmp_path: Path, path: Path) -> dict:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"messages": [{"role": "bot", "content": "hi"}]}) + "\n")
    return {}


def _no_assistant_turn(tmp_path: Path, path: Path) -> dict:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"messages": [{"role": "user", "content": "anyone?"}]}) + "\n")
    return {}


def _parquet_without_fields(tmp_path: Path, path: Path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"text": "plain"}]), tmp_path / "bad.parquet")
    return {"files": [str(path), str(tmp_path / "bad.parquet")]}


def _template_rewriting_earlier_turns(tmp_path: Path, path: Path) -> dict:
    """A template that writes an earlier answer shorter once a later message follows (as templates that drop
    earlier reasoning do): the conversation's start is not its first messages' rendering."""
    rewriting = TEMPLATE.replace("{{ m['content'] + '<|im_end|>\n' }}{% endgeneration %}",
                                 "{{ (m['content'] if loop.last else '...') + '<|im_end|>\n' }}{% endgeneration %}")
    assert rewriting != TEMPLATE
    return {"tokenizer": str(make_chat_tokenizer(tmp_path / "rewriting", rewriting))}


BAD_INPUT = {
    "missing file": ("data.files", _missing_file, "nope.jsonl does not exist"),
    "unknown extension": ("data.files", lambda tmp_path, path: {"files": [str(tmp_path / "chat.csv")]},
                          "is neither"),
    "row without the fields": ("data.messages_key", _row_without_fields, "row 13 of"),
    "parquet file without the fields": ("data.messages_key", _parquet_without_fields, "its columns: ['text']"),
    "unknown role": ("data.files", _unknown_role, "role is one of system, user, assistant; message 0 of row 13"),
    "no assistant turn": ("data.files", _no_assistant_turn, "at least one assistant message"),
    "template rewriting earlier turns": ("data.tokenizer", _template_rewriting_earlier_turns,
                                         "renders a conversation's first messages as the start of the whole"),
    "unknown too_long": ("data.too_long", lambda tmp_path, path: {"too_long": "wrap"}, "truncate or drop"),
    "tokenizer folder without tokenizer.json": ("data.tokenizer", lambda tmp_path, path: {"tokenizer": str(tmp_path)},
                                                "tokenizer.json"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_naming_the_key_the_value_and_what_is_allowed(tmp_path, chat_tokenizer, case):
    key, spoil, fragment = BAD_INPUT[case]
    path = write_jsonl(tmp_path / "chat.jsonl", conversations(12))
    options = {"files": [str(path)], "tokenizer": str(chat_tokenizer), **spoil(tmp_path, path)}
    with pytest.raises(ConfigError) as err:
        ChatConfig(**options).validate()
    assert err.value.key == key, err.value
    assert fragment in str(err.value) and "\n" not in str(err.value), err.value


def test_a_short_run_on_chat_rows_trains_and_reports_the_rows(tmp_path, chat_tokenizer, make_config):
    from disttrain.launch.job import train
    from tests.test_run import step_losses

    rows = conversations(16)
    rows[0]["messages"][-1]["content"] = "word " * 100
    path = write_jsonl(tmp_path / "data" / "chat.jsonl", rows)
    run_dir = tmp_path / "run"
    train(make_config(["model=hf", "model.arch=llama", "+model.hidden_size=32", "+model.intermediate_size=64",
                       "+model.num_hidden_layers=2", "+model.num_attention_heads=4", "+model.num_key_value_heads=2",
                       "+model.max_position_embeddings=128", "data=chat", "data.block_size=128", f"data.files=[{path}]",
                       f"data.tokenizer={chat_tokenizer}", "batch.global_size=4", "trainer.max_steps=2",
                       "trainer.log_every_n_steps=1", "trainer.limit_val_batches=1", "trainer.run_test=false",
                       "logger=csv", "callbacks=none"], run_dir))
    losses = step_losses(run_dir)
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    report = json.loads((run_dir / "results.json").read_text())["data"]
    assert report["rows_read"] == 16 and report["truncated"] == 1 and report["train_rows"] + report["val_rows"] == 16
    assert losses[0] == pytest.approx(math.log(302), rel=0.1)  # a fresh model over the tokenizer's 302 ids


CHAT_SGD = ["model=gpt", "model.flavour=micro", "model.n_layer=2", "model.tie_weights=false", "data=chat",
            "data.block_size=128", "batch.global_size=4", "trainer.max_steps=3", "trainer.val_check_interval=3",
            "trainer.check_val_every_n_epoch=null", "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1",
            "trainer.run_test=false", "logger=csv", "callbacks=none", "scheduler.warmup_fraction=0", "optim=sgd",
            "optim.momentum=0", "optim.nesterov=false", "optim.lr=0.5", "trainer.gradient_clip_val=100"]
"""Plain SGD, clipping far above the norms (each step's pre-clip norm is logged; no update is clipped)."""


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, chat_tokenizer):
    """``layout overrides -> run_summary`` on the same chat rows; the one-process run is made once."""
    from tests.test_parity import run_summary

    folder = tmp_path_factory.mktemp("chat-runs")
    path = write_jsonl(folder / "data" / "chat.jsonl", conversations(32))
    base = [*CHAT_SGD, f"data.files=[{path}]", f"data.tokenizer={chat_tokenizer}"]
    runs: dict[str, dict] = {}

    def run(name: str, layout: list[str]) -> dict:
        if name not in runs:
            runs[name] = run_summary(folder / name, [*base, *layout])
        return runs[name]

    return run


@pytest.mark.parametrize(("name", "layout"), [
    ("pp", ["parallel=pipeline", "parallel.pipeline.schedule=1f1b", "trainer.devices=2"]),
    ("cp", ["parallel.cp=2", "trainer.devices=2"])])
def test_chat_rows_train_under_pipeline_and_context_parallelism_as_in_one_process(chat_run, name, layout):
    from tests.test_parity import relative_deviation

    single, got = chat_run("single", []), chat_run(name, layout)
    assert len(got["losses"]) == len(got["norms"]) == 3 and got["last_step"] == 3
    assert relative_deviation(single["losses"], got["losses"]) <= 1e-6
    assert relative_deviation(single["norms"], got["norms"]) <= 1e-6
    assert got["val_loss"] == pytest.approx(single["val_loss"], rel=1e-6)
    for name, weight in got["weights"].items():
        torch.testing.assert_close(weight, single["weights"][name], rtol=0, atol=1e-6, msg=name)
