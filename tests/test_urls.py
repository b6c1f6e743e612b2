"""`redact_url` (shoal/urls.py): what a URL may show of itself."""

from __future__ import annotations

import pytest

from shoal.urls import redact_url


@pytest.mark.parametrize("cut", ["/", "?", "#"])
def test_a_password_of_digits_cut_short_by_a_raw_separator_is_never_shown(cut: str) -> None:
    """A password whose raw `/`, `?` or `#` ends the authority early, after digits alone
    (`svc:2024/Sec...`), read as a host and a port: the URL was shown whole with its
    password (`/`), or with the user and the password's first digits (`?`, `#`)."""
    url = f"https://svc:2024{cut}Secret@api.example.com/v1"
    shown = redact_url(url)
    assert "svc" not in shown and "2024" not in shown and "Secret" not in shown, shown
    assert shown.startswith("https://***@")


def test_a_path_holding_an_at_sign_after_a_port_is_shown_as_it_is() -> None:
    for url in ("http://h:8080/v1/@team", "http://h/v1/@team", "http://[::1]:80/v1/@team"):
        assert redact_url(url) == url
