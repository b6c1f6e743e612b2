"""`Upstream` reads the plain `http://host:port[/path]` URLs workers announce in one regular
expression match: what it makes of them is what `urllib.parse` makes of them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shoal.frontend.http.target import Target, parse_with_urllib
from shoal.frontend.http.upstream import Upstream

FIELDS = ("instance_id", "url", "address", "host", "tls", "port", "authorization", "provider",
          "path_prefix", "path_skip", "host_header", "label")  # fmt: skip


def parsed_by_urllib(instance_id: int, url: str, provider: bool) -> Target:
    return parse_with_urllib(instance_id, url, None, provider)


def fields(upstream: Upstream) -> Target:
    return tuple(getattr(upstream, name) for name in FIELDS)  # type: ignore[return-value]


def assert_same(url: str, provider: bool = False) -> None:
    fast = Upstream(0x2A, url, provider=provider)
    assert fields(fast) == parsed_by_urllib(0x2A, url, provider), url


def test_plain_urls_read_as_urllib_reads_them() -> None:
    for url in (
        "http://127.0.0.1:8081",
        "http://127.0.0.1:8081/",
        "http://127.0.0.1:8081/v1",
        "http://127.0.0.1:8081/v1/",
        "http://Worker-7.EXAMPLE.internal:00080/base/v1",
        "http://w:1/a/b/",
        "http://w:65535",
    ):
        assert_same(url)
        assert_same(url, provider=True)


hosts = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9.-]{0,20}", fullmatch=True)
paths = st.from_regex(r"(/[A-Za-z0-9._~-]{0,6}){0,4}", fullmatch=True)


@given(hosts, st.integers(0, 99999), paths, st.booleans())
def test_any_plain_url_reads_as_urllib_reads_it(
    host: str, port: int, path: str, provider: bool
) -> None:
    url = f"http://{host}:{port}{path}"
    try:
        slow = parsed_by_urllib(1, url, provider)
    except ValueError:  # (a port out of range)
        try:
            Upstream(1, url, provider=provider)
        except ValueError:
            return
        raise AssertionError(f"{url} was taken, urllib refuses it") from None
    fast = Upstream(1, url, provider=provider)
    assert fields(fast) == slow, url


def test_other_urls_still_take_urllib() -> None:
    with_credentials = Upstream(1, "http://user:p%40ss@worker:8000/v1")
    assert with_credentials.authorization is not None
    assert with_credentials.address == "http://worker:8000/v1"
    assert Upstream(1, "http://[::1]:8000").host == "::1"
    assert Upstream(1, "http://worker").port == 80
