"""Key patterns of ``remove_by_regex``: RE2, so a match costs time linear in the key's length.

Rules of this file:
- Patterns run on RE2 (the ``google-re2`` bindings), never on Python's backtracking ``re``: a
  pattern such as ``(.+)+z`` costs ``re`` time exponential in the key's length, and the core
  runs on the master's only event loop. RE2 guarantees time linear in the input, and memory
  bounded by ``MAX_PROGRAM_BYTES`` per compiled pattern, whatever the pattern.
- Keys are bytes, patterns are text: the pattern is matched against the key's bytes as Python's
  ``re.compile(pattern.encode())`` would (``.`` matches one byte, a non-ASCII character in the
  pattern matches its UTF-8 bytes). Syntax RE2 does not have (backreferences, lookaround)
  does not compile: the caller answers INVALID_ARGUMENT.
- Cost of one ``remove_by_regex``: one search per READY key, linear in the total bytes of all
  keys; nothing in it depends on the pattern beyond its (bounded) compiled size.
"""

from __future__ import annotations

from typing import Protocol, cast

import re2

#: Longest regex accepted, in characters.
MAX_PATTERN_CHARS = 4096
#: Memory RE2 may use for one compiled pattern (program and DFA cache); a larger pattern does
#: not compile. RE2's own default.
MAX_PROGRAM_BYTES = 8 << 20


class KeyPattern(Protocol):
    """A compiled pattern: ``search(key)`` is not None when some part of ``key`` matches."""

    def search(self, key: bytes) -> object | None: ...


def compile_key_pattern(pattern: object) -> KeyPattern | None:
    """Return the compiled pattern, or None when it is not a str, is longer than
    ``MAX_PATTERN_CHARS``, or is not a regex RE2 accepts."""
    if not isinstance(pattern, str) or len(pattern) > MAX_PATTERN_CHARS:
        return None
    try:
        raw = pattern.encode("utf-8", "surrogatepass")
    except UnicodeEncodeError:
        return None
    options = re2.Options()
    options.encoding = re2.Options.Encoding.LATIN1  # one byte is one character
    options.max_mem = MAX_PROGRAM_BYTES
    options.log_errors = False
    try:
        return cast(KeyPattern, re2.compile(raw, options))
    except (re2.error, ValueError, TypeError, OverflowError):
        return None
