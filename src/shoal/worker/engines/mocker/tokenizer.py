"""The mocker's tokenizer: a real Hugging Face `tokenizers` model, shipped as `tokenizer.json`.

Text splits into words and runs of punctuation (`\\w+|[^\\w\\s]+`, the `Whitespace`
pre-tokenizer: the cheapest there is); a word of the mocker's vocabulary is one token, any
other ASCII word or punctuation run is spelled with one token per character (WordPiece
continuation pieces), anything else is `[UNK]`.
The frontend loads the very file the mocker publishes, so both tokenize alike by
construction; likewise the chat template, published in `tokenizer_config.json`, renders a
chat exactly as `render_chat` does.
"""

from __future__ import annotations

import asyncio
import functools
import string
from collections.abc import Iterable
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from shoal.openai import ApiError, ChatMessage
from shoal.worker.engines.mocker.text import VOCAB

UNK = "[UNK]"
SPECIAL = (UNK, "<|begin|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>")
"""Matched whole wherever they appear (the chat template's role markers among them)."""
_CHARS = string.ascii_letters + string.digits + string.punctuation


def build_tokenizer(words: Iterable[str]) -> Tokenizer:
    """The tokenizer over `words` (plus single characters, so ASCII text is never unknown)."""
    vocab: dict[str, int] = {}
    for token in (*SPECIAL, *words, *_CHARS, *("##" + c for c in _CHARS)):
        vocab.setdefault(token, len(vocab))
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=UNK, max_input_chars_per_word=100))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return tokenizer


@functools.lru_cache(maxsize=4)
def tokenizer_json(words: tuple[str, ...]) -> str:
    """The `tokenizer.json` text of `build_tokenizer(words)`."""
    return str(build_tokenizer(words).to_str())


TOKENIZER = build_tokenizer(VOCAB)
"""The mocker's tokenizer, over the words it speaks."""

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


CHARS_PER_TOKEN = 16
"""The cheap bound checked before tokenizing: a text longer than this many characters per
token of room is refused without being tokenized (the mocker's tokens average about 5
characters; its longest word is 9)."""
INLINE_CHARS = 8192
"""Texts up to this many characters are tokenized on the event loop (under ~2 ms); longer
ones in a thread, so no prompt holds the loop (and the lease renewal on it)."""


def encode(text: str) -> list[int]:
    """The token ids of `text`, as the published `tokenizer.json` gives them. The batch call
    lets the GIL go while it works (and skips the offsets): `Tokenizer.encode` keeps it, so
    in a thread 60,000 words held the event loop ~50-75 ms all the same."""
    ids: list[int] = TOKENIZER.encode_batch_fast([text], add_special_tokens=False)[0].ids
    return ids


def check_length(text: str, room: int, param: str) -> None:
    """Refuse `text` (400 `context_length_exceeded` naming `param`) when it is so long that
    it cannot fit `room` tokens: a check on its length alone, before any tokenizing."""
    if len(text) > room * CHARS_PER_TOKEN:
        raise ApiError(
            400,
            f"This model's maximum context length is {room} tokens; the {param} has "
            f"{len(text)} characters, more than {CHARS_PER_TOKEN} per token of the context "
            "(checked before tokenizing).",
            param=param,
            code="context_length_exceeded",
        )


async def tokenize(text: str, room: int, param: str) -> list[int]:
    """The token ids of `text`, after the cheap length bound (`check_length`); a long text is
    tokenized in a thread, off the event loop."""
    check_length(text, room, param)
    if len(text) <= INLINE_CHARS:
        return encode(text)
    return await asyncio.to_thread(encode, text)


def render_chat(messages: Iterable[ChatMessage], *, add_generation_prompt: bool = True) -> str:
    """The prompt a chat becomes, as `CHAT_TEMPLATE` renders it."""
    parts = [f"<|{m.role}|>\n{render_chat_content(m.content)}\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


def render_chat_content(content: str | list[dict[str, Any]] | None) -> str:
    """A message's content as text: content parts (`[{"type": "text", ...}]`) joined."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content or ""
