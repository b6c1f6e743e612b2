"""The prompt of a request as the mocker reads it: one text, its token ids, what `echo` repeats."""

from __future__ import annotations

from typing import Any

from shoal.openai import ApiError, ChatRequest
from shoal.worker.engines.mocker.tokenizer import render_chat_content


def single_prompt(prompt: str | list[Any]) -> str:
    """A completions prompt as text: a string, `[string]`, token ids, or `[[token ids]]`."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str | list):
        return single_prompt(prompt[0])
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return " ".join(map(str, prompt))
    if not prompt:
        raise ApiError(400, "The prompt must not be empty.", param="prompt")
    raise ApiError(
        400,
        "The mocker takes one prompt per request: a string, a list of token ids, or a "
        "list holding one of those.",
        param="prompt",
    )


def prompt_size(prompt: str | list[Any]) -> int:
    """A cheap lower bound of a completions prompt's tokens when it is given as ids (the
    length of its id list, without looking at each), else 0."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str | list):
        return len(prompt)
    return 0


def prompt_ids(prompt: str | list[Any]) -> list[int] | None:
    """The token ids of a completions prompt given as ids (`[ids]` or `[[ids]]`), else None."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return list(prompt)
    return None


def chat_echo(req: ChatRequest) -> str:
    """With `echo`, the last message's text when it is the assistant's (vLLM's extension: the
    answer continues it)."""
    last = req.messages[-1]
    if not req.echo or last.role != "assistant":
        return ""
    return render_chat_content(last.content)
