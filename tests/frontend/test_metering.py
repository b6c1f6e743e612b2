"""`Metered`: what a response cost, told once at its end (unit tests, a fake connection)."""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from typing import Any

import pytest

from shoal.discovery.grants import Grant
from shoal.frontend.keys import metering
from shoal.frontend.keys.metering import Metered, usage_of
from shoal.openai import ApiError

GRANT = Grant(workspace="w", name="team", hash="a" * 64)


def test_the_last_usage_of_the_tail_counts_and_a_name_in_a_string_is_skipped() -> None:
    stream = (
        b'data: {"choices":[{"delta":{"content":"\\"prompt_tokens\\": 99"}}],"usage":null}\n\n'
        b'data: {"usage":{"prompt_tokens": 7, "completion_tokens":12}}\n\n'
        b'data: {"usage":{"prompt_tokens":8,"completion_tokens":13},"x":"\\"prompt_tokens\\""}\n\n'
        b"data: [DONE]\n\n"
    )
    assert usage_of(stream, events=4, request_bytes=400) == (8, 13)


def test_without_usage_the_gateway_counts_events_and_prompt_bytes() -> None:
    assert usage_of(b'data: {"x":1}\n\ndata: {"x":2}\n\ndata: [DONE]\n\n', 3, 400) == (100, 2)
    assert usage_of(b'{"usage":{"completion_tokens":5}}', 0, 40) == (10, 5)


class Conn:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.written: list[bytes] = []
        self.keep_alive = True
        self.writable = True

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def finish(self, error: ApiError | None = None) -> None:
        pass

    def send_error(self, error: ApiError) -> None:
        self.written.append(b"error")


class Gate:
    def __init__(self) -> None:
        self.ends: list[tuple[Any, ...]] = []
        self.records_usage = True  # tokens and the served model are looked for

    def done(self, *end: Any) -> None:
        self.ends.append(end)


def test_a_response_is_told_once_with_its_status_tokens_and_served_model() -> None:
    conn, gate = Conn(), Gate()
    metered = Metered(conn, 40, gate, GRANT, "alias")
    body = json.dumps({"model": "served-1", "usage": {"prompt_tokens": 3, "completion_tokens": 4}})
    head = b"HTTP/1.1 201 Created\r\ncontent-length: %d\r\n\r\n" % len(body)
    metered.write(head + body[:10].encode())
    metered.write(body[10:].encode())
    metered.finish()
    metered.finish()  # told once
    assert gate.ends == [(GRANT, "alias", 201, 3, 4, "served-1", 0, False, 0)]
    assert b"".join(conn.written) == head + body.encode()
    conn.loop.close()


def test_a_refused_request_costs_no_tokens_and_a_cut_stream_what_it_sent() -> None:
    conn, gate = Conn(), Gate()
    metered = Metered(conn, 40, gate, GRANT, "alias")
    metered.send_error(ApiError(503, "no instance"))
    assert gate.ends == [(GRANT, "alias", 503, 0, 0, "", 0, False, 0)]
    metered = Metered(conn, 40, gate, GRANT, "alias")
    metered.write(b'HTTP/1.1 200 OK\r\n\r\ndata: {"model":"m","usage":{"prompt_tokens":3}}\n\n')
    metered.write(b'data: {"x":1}\n\ndata: {"x":2}\n\n')
    metered.finish(ApiError(502, "cut"))  # after the first byte: the status stays 200
    assert gate.ends[-1] == (GRANT, "alias", 200, 3, 2, "m", 0, False, 0)
    conn.loop.close()


def test_nothing_is_looked_for_when_no_tpm_and_no_usage_book_need_it() -> None:
    conn, gate = Conn(), Gate()
    gate.records_usage = False
    metered = Metered(conn, 40, gate, GRANT, "alias")
    metered.write(b'HTTP/1.1 200 OK\r\n\r\n{"model":"m","usage":{"prompt_tokens":3}}')
    metered.finish()
    assert gate.ends == [(GRANT, "alias", 200, 0, 0, "", 0, False, 0)]
    conn.loop.close()


def test_a_request_whose_client_left_before_its_answer_costs_its_prompt() -> None:
    """A client that left after its request was forwarded, before the first byte of the
    answer, was charged 0 tokens (tpm and usage): any request could be made free by leaving
    early. It costs its prompt as the gateway counts it (bytes / 4) now; a refusal stays free."""
    conn, gate = Conn(), Gate()
    metered = Metered(conn, 4000, gate, GRANT, "alias")
    metered.finish()  # the connection ended before the upstream's first byte
    assert gate.ends == [(GRANT, "alias", 499, 1000, 0, "", 0, False, 0)]
    gate.records_usage = False  # (counted for tpm alone too)
    metered = Metered(conn, 4000, gate, GRANT, "alias")
    metered.finish()
    assert gate.ends[-1] == (GRANT, "alias", 499, 1000, 0, "", 0, False, 0)
    metered = Metered(conn, 4000, gate, GRANT, "alias")
    metered.send_error(ApiError(429, "over tpm"))  # refused before it was forwarded
    assert gate.ends[-1] == (GRANT, "alias", 429, 0, 0, "", 0, False, 0)
    conn.loop.close()


def test_a_usage_followed_by_more_than_the_tail_is_found_even_split_across_writes() -> None:
    """The usage of an answer that goes on for more than `TAIL` bytes after it (vLLM's
    `prompt_logprobs`) is found after its `"usage"` key, wherever the writes cut it."""
    from shoal.frontend.keys.metering import TAIL

    usage = b'"usage":{"prompt_tokens":10,"total_tokens":100,"completion_tokens":90}'
    body = b'{"model":"m","choices":[],' + usage + b',"prompt_logprobs":"' + b"x" * 2 * TAIL + b'"}'
    head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body)
    start = body.index(usage)
    for cut in (start + 3, start + 20, start + len(usage) - 5, start + len(usage) + 9):
        conn, gate = Conn(), Gate()
        metered = Metered(conn, 40, gate, GRANT, "alias")
        metered.write(head + body[:cut])
        metered.write(body[cut : cut + 5])
        metered.write(body[cut + 5 :])
        metered.finish()
        assert gate.ends == [(GRANT, "alias", 200, 10, 90, "m", 0, False, 0)], cut
        conn.loop.close()


def test_a_usage_string_after_the_usage_never_hides_it_wherever_the_writes_cut() -> None:
    """A `"usage"` that is not a key (a prompt's token echoed in vLLM's `prompt_logprobs`,
    after the answer's usage and more than `TAIL` bytes from its end) is skipped: the usage
    before it is charged, even when a write ends just after that `"usage"`; a later one that
    is a key, even split from its `:`, is the one charged."""
    from shoal.frontend.keys.metering import TAIL

    usage = b'"usage":{"prompt_tokens":10,"total_tokens":100,"completion_tokens":90}'
    fake = b'{"7":{"logprob":-0.5,"decoded_token":"usage"}},{"8":{"decoded_token":"usage" }}'
    pad = b",".join(b'{"%d":{"logprob":-1,"decoded_token":"x"}}' % n for n in range(150))
    body = b'{"model":"m",' + usage + b',"prompt_logprobs":[' + pad + b"," + fake + b"," + pad
    body += b"]}"
    assert len(body) - body.index(fake) > TAIL
    head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body)
    start = body.index(fake) + fake.index(b'"usage"')
    second = body.index(fake) + fake.rindex(b'"usage"')
    for cut in (start + 7, start + 5, start + 9, second + 7, second + 8, len(body) - 1):
        conn, gate = Conn(), Gate()
        metered = Metered(conn, 40, gate, GRANT, "alias")
        metered.write(head + body[:cut])
        metered.write(body[cut:])
        metered.finish()
        assert gate.ends == [(GRANT, "alias", 200, 10, 90, "m", 0, False, 0)], cut
        conn.loop.close()
    later = b'"usage" : {"prompt_tokens":3,"completion_tokens":4}'
    again = body[:-2] + b"]," + later + b',"x":"' + b"y" * 2 * TAIL + b'"}'
    at = len(body) - 2 + 2 + 7  # just after the later `"usage"`: its `:` in the next write
    conn, gate = Conn(), Gate()
    metered = Metered(conn, 40, gate, GRANT, "alias")
    metered.write(head + again[:at])
    metered.write(again[at:])
    metered.finish()
    assert gate.ends == [(GRANT, "alias", 200, 3, 4, "m", 0, False, 0)]
    conn.loop.close()


def test_a_prompt_tokens_string_in_the_tail_never_hides_the_usage_before_it() -> None:
    """The tail is preferred only when it holds a `"prompt_tokens"` key with its count: the
    same text as a string there (an echoed prompt token) leaves the usage found before."""
    from shoal.frontend.keys.metering import TAIL

    usage = b'"usage":{"prompt_tokens":10,"total_tokens":100,"completion_tokens":90}'
    pad = b",".join(b'{"%d":{"logprob":-1,"decoded_token":"x"}}' % n for n in range(150))
    fake = b'{"9":{"decoded_token":"prompt_tokens"}}'
    body = b'{"model":"m",' + usage + b',"prompt_logprobs":[' + pad + b"," + fake + b"]}"
    assert body.index(usage) < len(body) - TAIL < body.index(fake)
    conn, gate = Conn(), Gate()
    metered = Metered(conn, 40, gate, GRANT, "alias")
    metered.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    metered.finish()
    assert gate.ends == [(GRANT, "alias", 200, 10, 90, "m", 0, False, 0)]
    conn.loop.close()


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
ROLE = b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant"}}],"usage":null}\n\n'
TEXT = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a \\"usage\\": 1"}}]}\n\n'
USAGE = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":9}}\n\n'
DONE = b"data: [DONE]\n\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def unchunked(body: bytes) -> bytes:
    """The data of a chunked body (the client's view)."""
    out, at = [], 0
    while (size := int(body[at : body.index(b"\r\n", at)], 16)) > 0:
        start = body.index(b"\r\n", at) + 2
        out.append(body[start : start + size])
        at = start + size + 2
    assert body[at:] == b"0\r\n\r\n"
    return b"".join(out)


@pytest.mark.parametrize(
    "writes",
    [
        [HEAD + chunk(ROLE), chunk(TEXT), chunk(USAGE), chunk(DONE) + b"0\r\n\r\n"],
        [HEAD + chunk(ROLE) + chunk(TEXT), chunk(USAGE + DONE) + b"0\r\n\r\n"],  # one packet
        [HEAD + chunk(ROLE + TEXT + USAGE[:-1]), chunk(b"\n" + DONE), b"0\r\n\r\n"],  # cut
        [HEAD + chunk(ROLE), chunk(TEXT + USAGE[:-1]), chunk(b"\n"), chunk(DONE), b"0\r\n\r\n"],
    ],
    ids=["apart", "with-done", "blank-line-next", "blank-line-alone"],
)
def test_the_usage_event_asked_for_a_key_is_charged_and_never_written(writes: list[bytes]) -> None:
    """A key's stream whose client asked no usage event (`Proxy.ask_usage` asked the engine):
    the event, wherever the proxy's chunks cut its blank line, and the `"usage":null` the
    engine adds to other chunks once asked, are charged and read, never written."""
    conn, gate = Conn(), Gate()
    metered = Metered(conn, 40, gate, GRANT, "alias", hide_usage=True)
    for write in writes:
        metered.write(write)
    metered.finish()
    assert gate.ends == [(GRANT, "alias", 200, 7, 9, "", 0, False, 0)]
    written = b"".join(conn.written)
    assert written.startswith(HEAD)
    assert unchunked(written[len(HEAD) :]) == ROLE.replace(b',"usage":null', b"") + TEXT + DONE
    conn.loop.close()


def _lines(stream: bytes) -> list[bytes]:
    """`stream`'s lines, each with its line end (LF, CRLF or CR)."""
    lines, at = [], 0
    while at < len(stream):
        ends = [i for c in b"\r\n" if (i := stream.find(bytes([c]), at)) >= 0]
        end = min(ends) + 1
        end += stream[end - 1 : end + 1] == b"\r\n"
        lines.append(stream[at:end])
        at = end
    return lines


@pytest.mark.parametrize(
    ("newline", "fields", "after"),
    [(b"\n", b"", b""), (b"\r\n", b"", b""), (b"\r", b"", b""),
     (b"\n", b"event: chunk\n: note\n", b"id: 3\n"), (b"\r\n", b"id: 3\n", b"retry: 9\n")],
    ids=["lf", "crlf", "cr", "fields-lf", "fields-crlf"],
)  # fmt: skip
def test_the_usage_event_goes_whole_wherever_the_proxys_chunks_cut_its_lines(
    newline: bytes, fields: bytes, after: bytes
) -> None:
    """The proxy's chunks hold whole lines: cut before any line (two cuts, every pair) but
    between the usage event's own fields and its data (gone already then, they join the next
    event: harmless), the usage event leaves nothing behind (an `id:` after it alone was an
    event without data, on which the official client fails), whatever the line ends (SSE's
    LF, CRLF, CR), and the other events reach the client byte for byte, blank lines too."""
    usage = USAGE.replace(b"\n\n", b"\n")
    event = (fields + usage + after).replace(b"\n", newline) + newline
    text = TEXT.replace(b"\n\n", newline * 2)
    done = DONE.replace(b"\n\n", newline * 2)
    lines = _lines(text + event + done)
    before = len(_lines(text)) + len(_lines(fields))  # (the usage's data line)
    cuts = [cut for cut in range(1, len(lines)) if not len(_lines(text)) < cut <= before]
    for first in cuts:
        for second in cuts[cuts.index(first) :]:
            parts = [lines[:first], lines[first:second], lines[second:]]
            writes = [chunk(b"".join(part)) for part in parts if part]
            conn, gate = Conn(), Gate()
            metered = Metered(conn, 40, gate, GRANT, "alias", hide_usage=True)
            for write in [HEAD + writes[0], *writes[1:], b"0\r\n\r\n"]:
                metered.write(write)
            metered.finish()
            written = b"".join(conn.written)
            assert unchunked(written[len(HEAD) :]) == text + done, (first, second)
            assert gate.ends[0][3:5] == (7, 9)
            conn.loop.close()


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
def test_the_usage_event_goes_whole_wherever_the_engines_packets_cut_it(newline: bytes) -> None:
    """The engine's stream cut in two packets at every byte, each handed on as the proxy
    does (`sse.Unfinished`: whole events, which may end with the CR of a CRLF whose LF comes
    next): the client gets every other event byte for byte, nothing of the usage event's
    (its LF once came alone: a stray blank line)."""
    from shoal.frontend.proxy.sse import Unfinished

    text = TEXT.replace(b"\n\n", newline * 2)
    event = (USAGE.replace(b"\n\n", b"\nid: 2\n")).replace(b"\n", newline) + newline
    done = DONE.replace(b"\n\n", newline * 2)
    stream = text + event + done
    for cut in range(1, len(stream)):
        conn, gate = Conn(), Gate()
        metered = Metered(conn, 40, gate, GRANT, "alias", hide_usage=True)
        held, relayed, head = Unfinished(), b"", HEAD
        for packet in (stream[:cut], stream[cut:]):
            if out := held.take(packet, relayed[-2:]):
                metered.write(head + chunk(out))
                relayed, head = out, b""
        rest = held.release()
        metered.write(head + (chunk(rest) if rest else b"") + b"0\r\n\r\n")
        metered.finish()
        assert unchunked(b"".join(conn.written)[len(HEAD) :]) == text + done, cut
        assert gate.ends[0][3:5] == (7, 9)
        conn.loop.close()


def test_an_event_with_many_usage_keys_is_judged_once_and_never_decoded_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An event whose data holds 20,000 `"usage"` objects (an engine's own members, nested;
    600 KB, under the 1 MiB an event is held to) is decoded once, not once a key (then: 0.5 s
    of the event loop at 1,000 keys, 16.7 s at 4,000), and its members are checked as JSON
    text, never made into objects (then: 14.5 times the event's bytes, 10-85 ms). It is no
    usage event: it goes as it came."""
    decoded: list[int] = []

    def decode_event(payload: bytes) -> Any:
        decoded.append(len(payload))
        assert len(decoded) == 1, "the same event decoded again"
        return decode(payload)

    decode = metering._decode_event
    monkeypatch.setattr(metering, "_decode_event", decode_event)
    nested = b",".join([b'{"usage":{"prompt_tokens":1}}'] * 20000)
    event = b'data: {"choices":[{"index":0,"delta":{"content":"x"},"x":[%s]}]}\n\n' % nested
    conn, gate = Conn(), Gate()
    metered = Metered(conn, 40, gate, GRANT, "alias", hide_usage=True)
    metered.write(HEAD + chunk(ROLE))
    tracemalloc.start()
    try:
        metered.write(chunk(event))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    metered.write(chunk(DONE) + b"0\r\n\r\n")
    metered.finish()
    assert decoded == [len(event) - 7]  # (its data, once)
    assert peak < 4 * len(event), f"{peak / len(event):.1f} times the event's bytes"
    assert unchunked(b"".join(conn.written)[len(HEAD) :]).endswith(event + DONE)
    conn.loop.close()


def test_usage_in_chunks_with_choices_and_an_answer_not_chunked_go_as_they_are() -> None:
    """Usage the client gets anyway (vLLM's `continuous_usage_stats`, an engine's own) is
    left, and the last one charged; a body not chunked (an HTTP/1.0 client, a worker's
    `Content-Length`) is written as it came, its usage charged."""
    counted = (
        b'data: {"choices":[{"index":0,"text":"x"}],'
        b'"usage":{"prompt_tokens":3,"completion_tokens":%d}}\n\n'
    )
    stream = [HEAD + chunk(counted % 1), chunk(counted % 2 + DONE) + b"0\r\n\r\n"]
    sized = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(ROLE + USAGE + DONE)
    for writes in (stream, [sized + ROLE, USAGE + DONE]):
        conn, gate = Conn(), Gate()
        metered = Metered(conn, 40, gate, GRANT, "alias", hide_usage=True)
        for write in writes:
            metered.write(write)
        metered.finish()
        assert b"".join(conn.written) == b"".join(writes)
        assert gate.ends[0][3:5] == ((3, 2) if writes is stream else (7, 9))
        conn.loop.close()


def test_the_usage_option_is_merged_into_the_body_or_left_to_what_the_client_asked() -> None:
    from shoal.frontend.proxy.fields import ABSENT, LARGE_BODY, asking_usage, decode_fields

    def asked(body: dict[str, Any], members: dict[str, Any] | None = None) -> Any:
        raw = json.dumps(body).encode()
        options = decode_fields(raw, with_tokens=True).stream_options
        rewritten = asking_usage(raw, options, members)
        return None if rewritten is None else json.loads(rewritten)

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert asked(body) == {**body, "stream_options": {"include_usage": True}}
    merged = {**body, "stream_options": {"include_usage": False, "x": 1}}
    assert asked(merged) == {**body, "stream_options": {"include_usage": True, "x": 1}}
    assert asked({**body, "stream_options": None})["stream_options"] == {"include_usage": True}
    for options in ({"include_usage": "true"}, {"include_usage": 1},  # (as engines read them)
                    {"continuous_usage_stats": True}, "yes"):  # fmt: skip
        assert asked({**body, "stream_options": options}) is None, options
    large = {**body, "messages": [{"role": "user", "content": "x" * LARGE_BODY}]}
    assert asked({**large, "stream_options": {}}) is None  # (not decoded here: left as it came)
    members: dict[str, Any] = {}
    assert asked(large, members)["stream_options"] == {"include_usage": True}
    assert bytes(members["stream_options"]) == b'{"include_usage":true}'  # (a rebuild has it)
    assert asking_usage(b' \n{"model":"m"}', ABSENT) == (
        b' \n{"stream_options":{"include_usage":true},"model":"m"}'
    )
