"""Fuzz the client's path parsing (cachefs/paths.py) harder than tests/test_paths.py does.

Inputs are built from the pieces that break path handling: `..` and `.` in every disguise
(percent-encoded, full-width, one-dot leaders, NFKC look-alikes), NUL and control characters,
separators, very long and odd Unicode keys, non-strings. Each must parse to a key that stays
inside its mount, whatever the store does with Unicode normalisation, or be refused with
InvalidPathError (a ValueError and an OSError); nothing else may escape.
CI runs a few thousand inputs; ``CACHEFS_FUZZ_EXAMPLES`` scales them for a long mode.
"""

from __future__ import annotations

import os
import posixpath
import unicodedata

from hypothesis import given, settings
from hypothesis import strategies as st

from cachefs.errors import InvalidPathError
from cachefs.paths import MAX_KEY_BYTES, CachePath, parse_path, strip_protocol

EXAMPLES = int(os.environ.get("CACHEFS_FUZZ_EXAMPLES", "200")) * 5
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True)

# Pieces that mean "dot", "slash" or "nothing" to someone along the way.
_DISGUISES = ["..", ".", "", "/", "\\", "%2e", "%2E", "%2f", "%2F", "%5c", "%00", "%252e", "\x00", "\x7f", "\n",
              "\u2024", "\u2025", "\uff0e", "\uff0f", "\uff3c", "\u2215", "\u2044", "\ufe52", "\u0338", "\u200b",
              "\ufeff", "\u202e", "\u00a0", "\u3002", "ｄａｔａ", "cachefs://", "cachefs::", "~", "$HOME", "*", "?"]
_piece = st.one_of(st.sampled_from(_DISGUISES), st.text(max_size=12))
_path = st.one_of(
    st.lists(_piece, max_size=12).map("".join),
    st.lists(_piece, max_size=8).map("/".join),
    st.builds(lambda m, k: f"{m}/{k}", st.sampled_from(["data", "cachefs://data", "/data", "..", "ｄａｔａ"]),
              st.lists(_piece, max_size=8).map("/".join)),
    st.builds(lambda c, n: "data/" + c * n, st.sampled_from(["a", "é", "𝄞", "../", "a/", "\u2024"]),
              st.integers(0, 1200)),
)


def _inside(root: str, key: str) -> bool:
    joined = posixpath.normpath(posixpath.join(root, key))
    return joined == root or joined.startswith(root + "/")


def _check_accepted(cp: CachePath) -> None:
    key = cp.key
    assert len(key.encode("utf-8")) <= MAX_KEY_BYTES
    assert not key.startswith("/") and "\\" not in key and "\x00" not in key
    assert not any(unicodedata.category(c) == "Cc" for c in key)
    for form in (key, unicodedata.normalize("NFKC", key), unicodedata.normalize("NFC", key)):
        parts = form.split("/") if form else []
        assert ".." not in parts and "." not in parts, (key, form)
        assert _inside("/mnt/root", form), (key, form)  # also for a store that normalises Unicode
    assert parse_path(str(cp)) == cp and parse_path(cp.url) == cp  # stable round trip


@FUZZ
@given(_path)
def test_parse_accepts_only_keys_inside_their_mount(text):
    try:
        cp = parse_path(text)
    except InvalidPathError as exc:
        assert isinstance(exc, ValueError) and isinstance(exc, OSError)
        assert str(exc)  # a message that says why
        return
    _check_accepted(cp)


@FUZZ
@given(st.text(alphabet=st.characters(), min_size=0, max_size=2000))
def test_any_unicode_text_including_surrogates(text):
    try:
        cp = parse_path(text)
    except InvalidPathError:
        return
    _check_accepted(cp)


@FUZZ
@given(st.one_of(st.none(), st.integers(), st.binary(max_size=20), st.lists(st.text(max_size=3), max_size=3),
                 st.floats()))
def test_non_strings_are_refused_cleanly(value):
    try:
        strip_protocol(value)  # type: ignore[arg-type]
    except InvalidPathError:
        return
    raise AssertionError(f"{value!r} was accepted as a path")


def test_unicode_look_alikes_of_dots_and_slashes_are_refused():
    # Found by the fuzz above: NFKC turns these into '..' or '/', so a store or proxy that
    # normalises keys would see a path that escapes the mount.
    for key in ["\u2025", "\uff0e\uff0e", "a/\uff0e\uff0e/b", "a\uff0f\uff0e\uff0e\uff0fb", "\u2024\u2024/x"]:
        try:
            cp = parse_path(f"data/{key}")
        except InvalidPathError:
            continue
        raise AssertionError(f"{key!r} parsed to {cp!r}")
    assert parse_path("data/caf\u00e9/\u2024x").key == "caf\u00e9/\u2024x"  # harmless Unicode still passes
