"""Path parsing: nothing that escapes a mount gets through, and nothing crashes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefs.errors import InvalidPathError
from cachefs.paths import CachePath, parse_path


@pytest.mark.parametrize(
    "path, expected",
    [
        ("cachefs://data/a/b.bin", CachePath("data", "a/b.bin")),
        ("cachefs::data/x", CachePath("data", "x")),
        ("data/x/", CachePath("data", "x")),
        ("/data/x", CachePath("data", "x")),
        ("data", CachePath("data", "")),
        ("data/ünïcode ✓/ok", CachePath("data", "ünïcode ✓/ok")),
        ("data/100%/x", CachePath("data", "100%/x")),
    ],
)
def test_good_paths(path, expected):
    assert parse_path(path) == expected


@pytest.mark.parametrize(
    "path",
    ["", "cachefs://", "data/../x", "data/a/../../x", "data//x", "data/./x", "data/..", "data/a\x00b",
     "data/a%2Fb", "data/a%2fb", "data/%2E%2E/x", "data/a%5cb", "data/a%00", "data/a\\b", "data/a\nb",
     "../data/x", "./data", "da ta/x", "data/" + "k" * 1025, "data/\ud800"],
)
def test_bad_paths_are_refused(path):
    with pytest.raises(InvalidPathError):
        parse_path(path)


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=300))
def test_any_text_parses_or_is_refused_cleanly(text):
    try:
        cp = parse_path(text)
    except InvalidPathError:
        return
    parts = cp.key.split("/") if cp.key else []
    assert ".." not in parts and "." not in parts and "" not in parts
    assert "\x00" not in cp.key and "\\" not in cp.key
    assert parse_path(str(cp)) == cp  # round trip


def test_control_characters_are_exactly_unicodes_cc_category():
    import sys
    import unicodedata

    from cachefs.paths import _CONTROL_RE

    for code in range(0x3000):  # all of Cc lies below U+00A0; well past it for look-alikes
        ch = chr(code)
        assert bool(_CONTROL_RE.search(ch)) == (unicodedata.category(ch) == "Cc"), hex(code)
    assert all(unicodedata.category(chr(c)) != "Cc" for c in range(0x3000, sys.maxunicode + 1, 97))
