"""The mocker's embeddings: a deterministic unit vector per input text, as floats or base64."""

from __future__ import annotations

import array
import base64
import hashlib
import math
import sys
from typing import Any

from shoal.openai import ApiError

ENCODINGS = ("float", "base64")
MAX_INPUTS = 2048
"""Inputs one request may embed (OpenAI's limit)."""
MAX_VALUES = MAX_INPUTS * 256
"""Numbers one answer may hold (inputs x dimensions): checked before any is computed."""
MAX_CHARS = 4 * 1024 * 1024
"""Characters the inputs of one request may total, checked before any is tokenized."""


def embedding_inputs(value: str | list[Any]) -> list[str]:
    """The texts of an `input`: a string, strings, token ids, or lists of token ids."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise ApiError(400, "The input must not be empty.", param="input")
    if all(isinstance(v, str) for v in value):
        return list(value)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [" ".join(map(str, value))]
    if all(isinstance(v, list) and all(isinstance(t, int) for t in v) for v in value):
        return [" ".join(map(str, v)) for v in value]
    raise ApiError(
        400, "input must be a string, a list of strings, or token id lists.", param="input"
    )


def check_size(inputs: list[str], dimensions: int, model_dimensions: int) -> None:
    """Refuse, before any work, `dimensions` over the model's size (as vLLM and OpenAI do)
    and answers over the bounds: `MAX_INPUTS` inputs, `MAX_VALUES` numbers, `MAX_CHARS`."""
    if dimensions > model_dimensions:
        raise ApiError(
            400,
            f"dimensions {dimensions} exceeds the model's {model_dimensions} dimensions.",
            param="dimensions",
        )
    if len(inputs) > MAX_INPUTS:
        raise ApiError(
            400, f"input has {len(inputs)} items; at most {MAX_INPUTS} are allowed.", param="input"
        )
    if len(inputs) * dimensions > MAX_VALUES:
        raise ApiError(
            400,
            f"{len(inputs)} inputs of {dimensions} dimensions exceed the {MAX_VALUES} numbers "
            "one answer may hold.",
            param="input",
        )
    chars = sum(map(len, inputs))
    if chars > MAX_CHARS:
        raise ApiError(
            400, f"input totals {chars} characters; at most {MAX_CHARS} are allowed.", param="input"
        )


def check_encoding(encoding_format: str) -> None:
    """Refuse an `encoding_format` other than OpenAI's two."""
    if encoding_format not in ENCODINGS:
        raise ApiError(400, "encoding_format must be 'float' or 'base64'.", param="encoding_format")


def embed(text: str, dimensions: int) -> list[float]:
    """A deterministic unit vector for `text`."""
    raw = hashlib.shake_128(text.encode()).digest(dimensions * 2)
    values = array.array("H", raw)
    vec = [v / 32767.5 - 1.0 for v in values]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [v / norm for v in vec]


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """`vector` as the answer carries it: the floats, or base64 of little-endian float32s."""
    if encoding_format != "base64":
        return vector
    packed = array.array("f", vector)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode()
