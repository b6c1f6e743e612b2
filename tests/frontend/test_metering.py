"""`Metered`: what a response cost, told once at its end (unit tests, a fake connection)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from shoal.discovery.grants import Grant
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
