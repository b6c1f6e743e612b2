"""`PromptTokenizer`: a prompt's token ids as the worker computes them, for KV-aware routing.

Loaded from a worker set's verified metadata files: `tokenizer.json` (Hugging Face
`tokenizers`) and the chat template of `tokenizer_config.json`, rendered in a sandboxed
`jinja2` environment (templates come from workers, so they get no access to Python). As
vLLM does, a chat is rendered with the generation prompt and tokenized without special
tokens added; a completion prompt is tokenized with them.

Chats repeat themselves (a system prompt, a growing history), so a rendered chat is split
at the tokenizer's special tokens and each piece between them is tokenized once and kept:
the tokenizer itself tokenizes those pieces independently (special tokens are matched
first), so the ids are the same, at a fraction of the cost.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
PIECES_KEPT = 8192  # tokenized pieces of chats kept per tokenizer


class PromptTokenizer:
    """Tokenizes chat messages (through the chat template) and completion prompts."""

    def __init__(self, tokenizer: Tokenizer, config: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self._pieces: dict[str, list[int]] = {}
        self._split, self._special_ids = _special_split(tokenizer)
        self.specials = {
            name: _token_text(config.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        self.template: jinja2.Template | None = None
        if isinstance(template, str):
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self.template = env.from_string(template)

    @classmethod
    def load(cls, tokenizer_file: Path, config_file: Path | None) -> PromptTokenizer:
        """From the files on disk; raises (OSError, ValueError, jinja2 errors) if unusable."""
        config: dict[str, Any] = {}
        if config_file is not None:
            loaded = json.loads(config_file.read_text())
            config = loaded if isinstance(loaded, dict) else {}
        return cls(Tokenizer.from_file(str(tokenizer_file)), config)

    def chat(self, messages: list[Any]) -> list[int] | None:
        """The ids of a chat as the template renders it; None without a template."""
        if self.template is None:
            return None
        plain = [{"role": m.role, "content": _content_text(m.content)} for m in messages]
        text = self.template.render(messages=plain, add_generation_prompt=True, **self.specials)
        if self._split is None:
            return self._encode(text, special_tokens=False)
        return self._by_pieces(text, self._split)

    def _encode(self, text: str, *, special_tokens: bool) -> list[int]:
        """`text`'s ids; without the offsets `encode` also computes (three times faster)."""
        return list(
            self.tokenizer.encode_batch_fast([text], add_special_tokens=special_tokens)[0].ids
        )

    def _by_pieces(self, text: str, split: re.Pattern[str]) -> list[int]:
        """`text`'s ids, from the ids of its pieces between special tokens (kept)."""
        ids: list[int] = []
        pieces = self._pieces
        special = self._special_ids
        for i, piece in enumerate(split.split(text)):
            if i % 2:  # a special token (the pattern's one group)
                ids.append(special[piece])
                continue
            if not piece:
                continue
            known = pieces.get(piece)
            if known is None:
                known = self._encode(piece, special_tokens=False)
                if len(pieces) >= PIECES_KEPT:
                    del pieces[next(iter(pieces))]  # oldest first out
                pieces[piece] = known
            ids.extend(known)
        return ids

    def completion(self, prompt: Any) -> list[int] | None:
        """The ids of a completions prompt: text is tokenized, token ids are taken as they are."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._encode(prompt, special_tokens=True)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        return None


def _special_split(tokenizer: Tokenizer) -> tuple[re.Pattern[str] | None, dict[str, int]]:
    """A pattern splitting text at the special tokens, and their ids; no pattern when some
    added token is matched in a way a plain split would not reproduce (stripping, word
    boundaries, normalized matching)."""
    specials: dict[str, int] = {}
    for token_id, token in tokenizer.get_added_tokens_decoder().items():
        if token.lstrip or token.rstrip or token.single_word or token.normalized:
            return None, {}
        specials[token.content] = token_id
    if not specials:
        return None, {}
    longest_first = sorted(specials, key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, longest_first)) + ")"), specials


def _token_text(value: Any) -> str:
    """A special token from the config: a string, or an `AddedToken`-like dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def _content_text(content: Any) -> str:
    """A message's content as text: content parts joined, None as empty (as engines do)."""
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("text")
        )
    return content if isinstance(content, str) else ""


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
