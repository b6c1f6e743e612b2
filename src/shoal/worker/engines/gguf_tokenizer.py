"""`tokenizer.json` from a GGUF file's vocabulary, so a frontend tokenizes as llama.cpp does.

A GGUF file carries its tokenizer as metadata (`tokenizer.ggml.*`): the tokens, their types,
the BPE merges and the name of the pre-tokenizer. For byte-level BPE vocabularies (GPT-2
style: `tokenizer.ggml.model == "gpt2"`) with a pre-tokenizer whose splitting rules we know,
this builds the equivalent Hugging Face `tokenizers` model; for any other vocabulary it
returns None and the worker publishes no `tokenizer.json` (the frontend then routes that
model by prefix). Control and user-defined tokens become special added tokens, matched
whole in the text as llama.cpp matches them when it parses special tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp's token types (llama_token_type): control and user-defined tokens are matched whole.
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizers by `tokenizer.ggml.pre`: digits split one by one first, or not.
_GPT2_FAMILY = {"gpt2": False, "default": False, "smollm": True, "starcoder": True}


def _strings(reader: Any, key: str) -> list[str] | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def _ints(reader: Any, key: str) -> list[int] | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    return [int(field.parts[i][0]) for i in field.data]


def _scalar(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    part = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(part).decode("utf-8")
    return part[0].item() if hasattr(part[0], "item") else part[0]


def gguf_tokenizer(path: Path) -> Tokenizer | None:
    """The `tokenizers` equivalent of the GGUF file's tokenizer, or None if we cannot build it."""
    from gguf import GGUFReader  # the llamacpp extra

    reader = GGUFReader(str(path))
    if _scalar(reader, "tokenizer.ggml.model") != "gpt2":
        return None
    split_digits = _GPT2_FAMILY.get(str(_scalar(reader, "tokenizer.ggml.pre") or "default"))
    tokens = _strings(reader, "tokenizer.ggml.tokens")
    merges = _strings(reader, "tokenizer.ggml.merges")
    if split_digits is None or tokens is None or merges is None:
        return None
    types = _ints(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tokenizer = Tokenizer(models.BPE(vocab, pairs, ignore_merges=False))  # type: ignore[arg-type]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{N}"), "isolated"), byte_level])
        if split_digits
        else byte_level
    )
    tokenizer.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, types, strict=False)
        if kind in (_CONTROL, _USER_DEFINED)
    ]
    tokenizer.add_special_tokens(specials)
    bos = _scalar(reader, "tokenizer.ggml.bos_token_id")
    if _scalar(reader, "tokenizer.ggml.add_bos_token") and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], int(bos))]
        )
    return tokenizer
