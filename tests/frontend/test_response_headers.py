"""Which response headers reach the client: the verdict per name, remembered within a bound."""

from __future__ import annotations

import pytest

from shoal.frontend.proxy import headers
from shoal.frontend.proxy.headers import (
    MAX_VERDICTS,
    RESPONSE_HEADER_RELAYED,
    response_header_relayed,
)


@pytest.mark.parametrize(
    ("name", "relayed"),
    [
        (b"content-type", True),
        (b"Content-Type", True),
        (b"X-Request-Id", True),
        (b"Transfer-Encoding", False),
        (b"connection", False),
        (b"X-Shoal-Instance", False),  # the gateway's own
        (b"Access-Control-Allow-Origin", False),  # the gateway's CORS policy alone decides
    ],
)
def test_a_verdict_is_the_same_whether_worked_out_or_remembered(name: bytes, relayed: bool) -> None:
    assert response_header_relayed(name) is relayed
    assert RESPONSE_HEADER_RELAYED[name] is relayed
    assert response_header_relayed(name) is relayed


def test_the_verdicts_kept_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(headers, "RESPONSE_HEADER_RELAYED", {})
    kept = headers.RESPONSE_HEADER_RELAYED
    for i in range(MAX_VERDICTS * 2):  # an upstream inventing names without end
        assert headers.response_header_relayed(b"x-made-up-%d" % i)
    assert len(kept) == MAX_VERDICTS
