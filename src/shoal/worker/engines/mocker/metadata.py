"""The files a mocker model is described by, as a Hugging Face model directory holds them.

`config.json`, `tokenizer.json` and `tokenizer_config.json` (with the chat template) for the
base model and each adapter, plus `adapter_config.json` for an adapter: the frontend fetches
and verifies them, and tokenizes prompts with them exactly as the mocker does.
"""

from __future__ import annotations

import json
from pathlib import Path

from shoal.urls import redact_url
from shoal.worker.engines.mocker.text import VOCAB
from shoal.worker.engines.mocker.tokenizer import CHAT_TEMPLATE, tokenizer_json


def write_model_files(
    target: Path,
    *,
    context_length: int,
    hidden_size: int,
    kv_block_size: int,
    chat_template: str | None = None,
) -> None:
    """Write the model's `config.json` and tokenizer files into `target` (created), with
    `chat_template` instead of the mocker's own when given."""
    target.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["MockerForCausalLM"],
        "model_type": "mocker",
        "max_position_embeddings": context_length,
        "vocab_size": len(VOCAB),
        "hidden_size": hidden_size,
        "kv_block_size": kv_block_size,
    }
    tokenizer = {
        "model_max_length": context_length,
        "bos_token": "<|begin|>",
        "eos_token": "<|end|>",
        "unk_token": "[UNK]",
        "chat_template": CHAT_TEMPLATE if chat_template is None else chat_template,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (target / "config.json").write_text(json.dumps(config, indent=2))
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer, indent=2))
    (target / "tokenizer.json").write_text(tokenizer_json(VOCAB))


def write_adapter_config(target: Path, *, base_model: str, source: str) -> None:
    """Write a LoRA adapter's `adapter_config.json` into `target` (hosted without a token:
    `source` without a URL's credentials)."""
    config = {
        "base_model_name_or_path": base_model,
        "peft_type": "LORA",
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj"],
        "source": redact_url(source),
    }
    (target / "adapter_config.json").write_text(json.dumps(config, indent=2))
