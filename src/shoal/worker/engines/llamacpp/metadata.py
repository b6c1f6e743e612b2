"""The model's non-weight files (config.json, tokenizer_config.json with the chat template,
tokenizer.json when its vocabulary allows), written from its GGUF metadata for the runtime
to host.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def write_metadata(llm: Any, directory: Path, gguf_path: Path | None = None) -> tuple[str, ...]:
    """Write config.json and tokenizer_config.json from the GGUF metadata, and tokenizer.json
    from its vocabulary when `gguf_tokenizer` can build it (engine thread)."""
    metadata: dict[str, str] = dict(llm.metadata)
    arch = metadata.get("general.architecture", "unknown")

    def number(key: str) -> int | None:
        value = metadata.get(key, "")
        return int(value) if value.isdigit() else None

    def token_text(token: int | None) -> str | None:
        if token is None or token < 0:
            return None
        return str(llm.detokenize([token], special=True).decode("utf-8", errors="replace"))

    config = {
        "model_type": arch,
        "name": metadata.get("general.name"),
        "n_ctx": llm.n_ctx(),
        "vocab_size": llm.n_vocab(),
        "max_position_embeddings": number(f"{arch}.context_length"),
        "hidden_size": number(f"{arch}.embedding_length"),
        "num_hidden_layers": number(f"{arch}.block_count"),
        "num_attention_heads": number(f"{arch}.attention.head_count"),
        "num_key_value_heads": number(f"{arch}.attention.head_count_kv"),
        "bos_token_id": number("tokenizer.ggml.bos_token_id"),
        "eos_token_id": number("tokenizer.ggml.eos_token_id"),
    }
    tokenizer = {
        "bos_token": token_text(number("tokenizer.ggml.bos_token_id")),
        "eos_token": token_text(number("tokenizer.ggml.eos_token_id")),
        "add_bos_token": metadata.get("tokenizer.ggml.add_bos_token") == "true",
        "model_max_length": llm.n_ctx(),
        "chat_template": metadata.get("tokenizer.chat_template"),
    }
    files = {"config.json": config, "tokenizer_config.json": tokenizer}
    for name, fields in files.items():
        present = {key: value for key, value in fields.items() if value is not None}
        (directory / name).write_text(json.dumps(present, indent=2, sort_keys=True) + "\n")
    names = tuple(files)
    tokenizer_json = gguf_path and _gguf_tokenizer_json(gguf_path)
    if tokenizer_json:
        (directory / "tokenizer.json").write_text(tokenizer_json)
        names += ("tokenizer.json",)
    return names


def _gguf_tokenizer_json(path: Path) -> str | None:
    try:
        from shoal.worker.engines.gguf_tokenizer import gguf_tokenizer

        tokenizer = gguf_tokenizer(path)
    except Exception as exc:  # the model serves anyway; the frontend routes it by prefix
        log.warning("no tokenizer.json for %s: %s", path, exc)
        return None
    if tokenizer is None:
        log.info("no tokenizer.json for %s: its GGUF vocabulary is not byte-level BPE", path)
        return None
    return str(tokenizer.to_str())
