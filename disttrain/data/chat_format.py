"""A conversation as token ids and the mask of the assistant's tokens, through the tokenizer's own chat template.

The tokenizer folder is read locally (its ``tokenizer.json`` checked by ``token_cache.load_tokenizer``, then
``transformers``' ``PreTrainedTokenizerFast.from_pretrained`` with local files only, which also reads the folder's
chat template and special tokens); nothing downloads and no code from the folder runs. A tokenizer without a chat
template is given ``PLAIN_CHAT_TEMPLATE``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from disttrain.data.chat_rows import Conversation
from disttrain.data.token_cache import load_tokenizer
from disttrain.errors import ConfigError

PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' and eos_token %}{{ eos_token }}{% endif %}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
"""The template of a tokenizer that has none: each message as ``<|role|>`` on a line of its own, then its
content and a newline, an assistant's content followed by the tokenizer's end-of-text token where it has one;
the generation prompt is ``<|assistant|>`` and a newline."""


def load_chat_tokenizer(folder: str) -> Any:
    """The ``transformers`` fast tokenizer saved in ``folder`` (read locally), with ``PLAIN_CHAT_TEMPLATE`` where
    the folder holds no chat template."""
    folder = os.path.abspath(os.path.expanduser(folder))
    load_tokenizer(folder)  # the project's reader: one line naming data.tokenizer for a missing or broken file
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise ConfigError("data.tokenizer", folder, "usable once transformers is installed "
                                                   "(pip install 'disttrain[hf]')") from None
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    except Exception as err:  # a malformed tokenizer_config.json or chat template file
        raise ConfigError("data.tokenizer", folder, f"a tokenizer folder transformers reads: {err}") from None
    if not tokenizer.chat_template:
        tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    return tokenizer


def render(tokenizer: Any, messages: Conversation, generation_prompt: bool, where: str) -> str:
    """``messages`` as the chat template writes them (text, not yet tokens)."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as err:  # the template's own raise_exception, or Jinja's errors
        raise ConfigError("data.tokenizer", tokenizer.name_or_path,
                          f"a chat template that renders every row; {where}: {err}") from None


def assistant_spans(tokenizer: Any, messages: Conversation, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The whole conversation's text and the character spans of the assistant's turns in it.

    Each assistant turn is found by rendering the conversation prefix by prefix: the messages before it with the
    generation prompt end where the turn starts, the messages up to it end where it ends (its closing tokens
    included, so the model learns to stop). This works with every chat template, where ``transformers``'
    ``return_assistant_tokens_mask`` needs templates that mark the turns with ``{% generation %}``, which most
    do not. A template whose prefixes are not the start of the whole (one that rewrites earlier turns, e.g. drops
    their reasoning) cannot be split this way and is refused.
    """
    text = render(tokenizer, messages, False, where)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        # an opening assistant message starts with the text (an empty conversation may not render at all)
        before = render(tokenizer, messages[:index], True, where) if index else ""
        through = render(tokenizer, messages[:index + 1], False, where)
        if not (text.startswith(before) and text.startswith(through)):
            raise ConfigError("data.tokenizer", tokenizer.name_or_path,
                              "a chat template that renders a conversation's first messages as the start of the "
                              f"whole; it renders message {index} of {where} otherwise")
        spans.append((len(before), len(through)))
    return text, spans


def tokenize_conversation(tokenizer: Any, messages: Conversation, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the rendered conversation and whether each is the assistant's.

    The text is tokenised once, whole (the template writes the special tokens itself, so the tokenizer adds
    none), and a token is the assistant's when its characters overlap an assistant span: a token that straddles
    a span's edge carries response text, so it is learned.
    """
    text, spans = assistant_spans(tokenizer, messages, where)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoded["input_ids"], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.bool_)
    for position, (first, last) in enumerate(encoded["offset_mapping"]):
        mask[position] = any(first < end and last > start for start, end in spans)
    return ids, mask
