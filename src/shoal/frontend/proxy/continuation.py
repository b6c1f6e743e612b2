"""The request that continues a migrated stream (migration.py): the client's body with the
text so far spliced in, as JSON text; the continuation's events as the client's stream has
them (`event`); and what decides, at a failure, that the stream is not continued: what its
body asks (`refusal`), a stop string cut at the splice, or no tokens left (`halt`: the
gateway then ends the stream itself, `ending`).

The client's body is read one level deep, and its messages or prompt are spliced as they
came, never decoded: the body is joined once (a 14 MB prompt decoded and encoded again held
the event loop for ~50 ms at the failure)."""

from __future__ import annotations

from typing import Any

import msgspec

from shoal.frontend.proxy import sse

_decode_any = msgspec.json.Decoder().decode
_decode_members = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode_list = msgspec.json.Decoder(list[msgspec.Raw]).decode
_TRUE, _FALSE = msgspec.Raw(b"true"), msgspec.Raw(b"false")
_encode = msgspec.json.encode
COMPLETION_DEFAULT = 16  # `max_tokens` of a completion that names none (vLLM, SGLang, OpenAI)
MAX_DECODED = 1 << 20
"""Bytes of messages a continuation of the client's own continuation decodes to extend its
last message (13 MB took 40-65 ms); past them the stream does not migrate."""


def body(
    origin: bytes, members: dict[str, msgspec.Raw] | None, chat: bool, text: str, tokens: int
) -> bytes | None:
    """The continuation of `origin` (the client's body; `members`, its members if already
    read) after `text`, the `tokens` generated so far: chat with the text as a final
    assistant message, a completion with it appended to the prompt, `max_tokens`,
    `max_completion_tokens` and `min_tokens` less the tokens (a completion that names no
    `max_tokens`: the engines' default, less them). None when it cannot be continued."""
    try:
        members = members or _decode_members(origin)
        encoded = _encode(text)  # (a JSON string: `"..."`)
        spliced: dict[str, msgspec.Raw | tuple[Any, ...]] = dict(members)
        if chat:
            messages = _continued_messages(members, encoded)
            if messages is None:
                return None
            spliced["messages"] = messages
            spliced["continue_final_message"] = _TRUE
            spliced["add_generation_prompt"] = _FALSE
        else:
            prompt = _continued_prompt(members.get("prompt"), encoded)
            if prompt is None:
                return None
            spliced["prompt"] = prompt
        if not chat and "max_tokens" not in members:  # (engines' default for completions)
            spliced["max_tokens"] = msgspec.Raw(b"%d" % max(COMPLETION_DEFAULT - tokens, 1))
        limits = _limits(members)
        for key, least in (("max_tokens", 1), ("max_completion_tokens", 1), ("min_tokens", 0)):
            if key in limits:
                spliced[key] = msgspec.Raw(b"%d" % max(limits[key] - tokens, least))
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    return _joined(spliced)


def counted(usage: Any, carried: int) -> int:
    """The tokens generated so far by the count of a stream's `usage` (decoded; engines send
    it in every chunk with `stream_options.continuous_usage_stats`), plus the `carried` ones
    a continuation's prompt holds; 0 when it counts none. Without it the chunks are counted,
    one token each: a lower bound, as an engine may put several tokens in a chunk."""
    completion = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if isinstance(completion, int) and not isinstance(completion, bool) and completion >= 0:
        return carried + completion
    return 0


def tokens_of(chunks: list[sse.Chunk], tokens: int, carried: int) -> int:
    """The tokens generated after `chunks`, `tokens` before them: one per piece of text,
    unless a chunk's usage counts more (`counted`), as reading each chunk alone counts."""
    for chunk in chunks:
        for choice in chunk.choices or ():
            piece = choice.text if choice.delta is None else choice.delta.content
            tokens += 1 if piece and isinstance(piece, str) else 0
        if chunk.usage is not None:
            tokens = max(tokens, counted(chunk.usage, carried))
    return tokens


def _limits(members: dict[str, msgspec.Raw]) -> dict[str, int]:
    """The integer `max_tokens`, `max_completion_tokens` and `min_tokens` of a body."""
    limits: dict[str, int] = {}
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        raw = members.get(key)
        value = None if raw is None or len(raw) > 20 else _decode_any(raw)
        if isinstance(value, float) and value.is_integer():  # (`10.0`: read as 10)
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            limits[key] = value
    return limits


def _continued_messages(members: dict[str, msgspec.Raw], text: bytes) -> tuple[Any, ...] | None:
    """The pieces of the client's messages with `text` (JSON) as the assistant's: a new final
    message, or the end of the client's own final assistant message when it asked to
    continue that one."""
    raw = members.get("messages")
    if raw is None or _first(raw) != b"[":
        return None
    if asked(members.get("continue_final_message")):
        if len(raw) > MAX_DECODED:
            return None  # (a long chat decoded and joined again holds the event loop)
        items = _decode_list(raw)  # (the client's own continuation: rare)
        last = _decode_members(items[-1]) if items and _first(items[-1]) == b"{" else {}
        content = last.get("content")
        if _decode_any(last.get("role", b"null")) == "assistant" and _first(content) == b'"':
            last["content"] = msgspec.Raw(_joined_string(content, text))
            items[-1] = msgspec.Raw(_joined(last))
            return (b"[", *[p for item in items for p in (b",", item)][1:], b"]")
    head = memoryview(raw)[:-1]  # (the added message goes before the `]`, spaces before it cut)
    tail = bytes(head[-64:])
    cut = len(tail) - len(tail.rstrip())
    head = head[: len(head) - cut] if cut < 64 else memoryview(bytes(head).rstrip())
    added = b'{"role":"assistant","content":' + text + b"}"
    return (head, b"," if len(head) > 1 else b"", added, b"]")


def _continued_prompt(raw: msgspec.Raw | None, text: bytes) -> tuple[Any, ...] | None:
    """A completion's prompt (one string, or a list of one) with `text` (JSON) appended."""
    if raw is None:
        return None
    if _first(raw) == b'"':
        return (_joined_string(raw, text),)
    if _first(raw) == b"[":
        items = _decode_list(raw)
        if len(items) == 1 and _first(items[0]) == b'"':
            return (b"[", _joined_string(items[0], text), b"]")
    return None


def asked(raw: msgspec.Raw | None) -> bool:
    """A boolean member as engines' lax readers (pydantic's default) take it: `true`, `1`,
    `"true"`, `"yes"`, `"on"`, ..."""
    if raw is None or len(raw) > 16:
        return False
    try:
        value = _decode_any(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on", "t", "y")
    return value is True or (type(value) in (int, float) and value == 1)


def _first(raw: msgspec.Raw | None) -> bytes:
    """The first byte of a JSON value (b"" for none): its kind, without copying it."""
    return b"" if raw is None else bytes(memoryview(raw)[:1])


def _joined_string(string: Any, text: bytes) -> bytes:
    """Two JSON strings as one: `"ab"` and `"cd"` make `"abcd"` (no decoding)."""
    return b"".join((memoryview(string)[:-1], memoryview(text)[1:]))


def _joined(members: dict[str, Any]) -> bytes:
    """A JSON object of `members` (each JSON text, or a tuple of its pieces), joined once."""
    parts: list[Any] = []
    for key, value in members.items():
        parts += (b",", _encode(key), b":", *(value if isinstance(value, tuple) else (value,)))
    parts[:1] = [b"{"]
    return b"".join([*parts, b"}"]) if parts else b"{}"


class _Format(msgspec.Struct):
    type: Any = None


_decode_format = msgspec.json.Decoder(_Format).decode


# Members that constrain what the engine generates from the start of its answer: a grammar
# applied again to a continuation starts a new document after the half-sent one.
STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
              "structured_outputs", "json_schema", "regex", "ebnf")  # fmt: skip


def refusal(members: dict[str, msgspec.Raw], chat: bool) -> str | None:
    """Why a request's stream cannot be continued elsewhere, or None."""
    keys = ("n", "logprobs", "top_logprobs", "echo")
    asked = {key: _decode_any(members[key]) for key in keys if key in members}
    if asked.get("n") not in (None, 1):
        return "n"
    logprobs = asked.get("logprobs")  # (0 asks too: `0 in (None, False)` said it did not)
    if (logprobs is not None and logprobs is not False) or asked.get("top_logprobs"):
        return "logprobs"
    if asked.get("echo"):
        return "echo"
    if any(bytes(members[k]).strip() != b"null" for k in STRUCTURED if k in members):
        return "structured"
    form = members.get("response_format")  # (its schema skipped, unread)
    if _first(form) == b"{" and _decode_format(form or b"{}").type not in (None, "text"):
        return "structured"
    if not chat:
        prompt = members.get("prompt")
        start = b"" if prompt is None else bytes(memoryview(prompt)[:64]).lstrip(b" \t\r\n[")
        if not start.startswith(b'"'):
            return "prompt"  # token ids, or no prompt: only text is continued
    return None


def event(payload: bytes, roleless: bool, ident: tuple[Any, Any], usage: Any, carried: int) -> (
    bytes | None
):  # fmt: skip
    """A continuation's event (its data, `payload`) as the client's stream has it: the
    stream's `id` and `created` (`ident`), without the `role` of its deltas (`roleless`: the
    client had one), its `usage` (decoded) with the `carried` tokens moved from the prompt
    back to the completion. Its other members as they came (only the top level is read).
    None when it is no JSON object."""
    try:
        members = _decode_members(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    if roleless and "choices" in members:  # (usage, or content, beside the role)
        members["choices"] = _raw(_roleless(members["choices"]))
    members["id"], members["created"] = _raw(ident[0]), _raw(ident[1])
    if isinstance(usage, dict) and carried:
        completion = usage.get("completion_tokens")
        prompt = usage.get("prompt_tokens")
        if isinstance(completion, int):
            usage["completion_tokens"] = completion + carried
        if isinstance(prompt, int):
            usage["prompt_tokens"] = max(prompt - carried, 0)
        members["usage"] = _raw(usage)
    return b"data: " + _encode(members) + b"\n\n"


def _roleless(choices: msgspec.Raw) -> Any:
    """A continuation's choices without the `role` of their deltas (the client had one)."""
    decoded = _decode_any(choices)
    for choice in decoded if isinstance(decoded, list) else ():
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if isinstance(delta, dict):
            delta.pop("role", None)
    return decoded


def _raw(value: Any) -> msgspec.Raw:
    return msgspec.Raw(_encode(value))


MAX_STOP = 4096
"""Bytes of a body's `stop` compared with the end of the text at a failure; a longer `stop`
is taken as cut at the splice (the stream is not continued)."""


def halt(members: dict[str, msgspec.Raw], chat: bool, text: str, tokens: int) -> str | None:
    """Why a stream with `text`, `tokens`, generated so far is not continued though its body
    allows it: "length" when it has no tokens left (the gateway ends it: `ending`), "stop"
    when the text ends with the start of one of its stop strings (engines look for them in
    the text they generate, never in the text they continue: the rest of one would pass);
    else None."""
    limits = _limits(members)
    if chat:  # (vLLM and SGLang: `max_completion_tokens` first)
        limit = limits.get("max_completion_tokens") or limits.get("max_tokens")
    else:
        default = None if "max_tokens" in members else COMPLETION_DEFAULT
        limit = limits.get("max_tokens", default)
    if limit is not None and tokens >= limit:
        return "length"
    raw = members.get("stop")
    if raw is None or not text:
        return None
    if len(raw) > MAX_STOP:
        return "stop"
    stop = _decode_any(raw)
    for string in [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else ():
        if isinstance(string, str) and string and _cut(text, string):
            return "stop"
    return None


def _cut(text: str, stop: str) -> bool:
    """Whether `text` ends with a proper prefix of `stop` (its first character found from
    each candidate start: a few comparisons, not one per length)."""
    tail = text[-(len(stop) - 1) :] if len(stop) > 1 else ""
    at = tail.find(stop[0])
    while at >= 0:
        if stop.startswith(tail[at:]):
            return True
        at = tail.find(stop[0], at + 1)
    return False


def ending(
    members: dict[str, msgspec.Raw], chat: bool, ident: tuple[Any, Any, Any], tokens: int,
    usage: Any, size: int,
) -> bytes:  # fmt: skip
    """The end of a stream whose instance failed with no tokens left to generate, as the
    engine would have sent it: a chunk with finish reason "length" under the stream's `id`,
    `created` and `model` (`ident`), the usage chunk if the client asked for one (the
    `tokens` it received; the prompt's tokens from the `usage` the stream carried, else the
    body's `size` / 4, as the gate counts a stream without usage), then `[DONE]`."""
    head = {"id": ident[0], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": ident[1], "model": ident[2]}  # fmt: skip
    choice = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
    events = [{**head, "choices": [{**choice, "logprobs": None, "finish_reason": "length"}]}]
    options = members.get("stream_options")
    if _first(options) == b"{" and asked(_decode_members(options or b"{}").get("include_usage")):
        prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        prompt = prompt if isinstance(prompt, int) and prompt >= 0 else size // 4
        counts = {"prompt_tokens": prompt, "completion_tokens": tokens}
        events.append({**head, "choices": [], "usage": {**counts, "total_tokens": prompt + tokens}})
    return b"".join([b"data: %s\n\n" % _encode(e) for e in events]) + sse.DONE
