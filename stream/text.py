"""Incremental text buffer: cuts streamed text into segments (one generation each).

Text arrives in pieces (LLM tokens or whole sentences) and is concatenated verbatim. A segment is
cut at once at a confirmed sentence end; a buffer that looks finished (ends in '.', '!', '?') is
cut after a short idle delay, any other buffer after a longer one; `flush()` cuts everything.
No clock inside: callers pass `now` (seconds, any monotonic origin).
"""

from __future__ import annotations

import re

_CLOSERS = "\"'”’)\\]}»」』"
# 1: Latin sentence end confirmed by following whitespace; 3: CJK sentence end (no space needed);
# 5: a blank line.
_BOUNDARY = re.compile(
    rf"([.!?…]+[{_CLOSERS}]*)(\s+)|([。！？]+[{_CLOSERS}]*)|(\n[ \t\r]*\n\s*)"
)
_LOOKS_FINISHED = re.compile(rf"[.!?…。！？][{_CLOSERS}]*\s*$")
_CLAUSE = re.compile(r"[,;:，；：、]\s")
_ABBREVIATIONS = frozenset(
    ["mr", "mrs", "ms", "dr", "st", "prof", "sr", "jr", "vs", "e.g", "i.e", "approx", "dept"]
)


def _is_abbreviation(before: str) -> bool:
    """True when the word ending at a '.' is an abbreviation or an initial ("Dr.", "J.")."""
    m = re.search(r"(\S+)$", before)
    if m is None:
        return False
    word = m.group(1).lstrip(_CLOSERS + "(\"'")
    if len(word) == 1 and word.isalpha() and word.isupper():
        return True
    return word.lower() in _ABBREVIATIONS


def _cut_long(text: str, limit: int) -> int:
    """Where to cut `text` (longer than `limit`) so the head is at most `limit` chars."""
    window = text[: limit + 1]
    clauses = [m.end() - 1 for m in _CLAUSE.finditer(window) if m.end() - 1 >= limit // 2]
    if clauses:
        return clauses[-1]
    space = window.rfind(" ")
    if space > 0:
        return space
    return limit


class TextBuffer:
    """Segments one context's text. `append`/`flush`/`poll` return finished segments (stripped)."""

    def __init__(self, max_segment_chars: int = 400, max_delay_s: float = 1.0,
                 sentence_delay_s: float = 0.15):
        assert max_segment_chars >= 1, f"max_segment_chars must be >= 1, got {max_segment_chars}"
        assert max_delay_s >= 0 and sentence_delay_s >= 0, "delays must be >= 0"
        self.max_segment_chars = max_segment_chars
        self.max_delay_s = max_delay_s
        self.sentence_delay_s = min(sentence_delay_s, max_delay_s)
        self._buf = ""
        self._last_append: float | None = None

    @property
    def pending(self) -> str:
        return self._buf

    def append(self, text: str, now: float) -> list[str]:
        self._buf = (self._buf + text).lstrip()
        self._last_append = now
        return self._cut()

    def flush(self) -> list[str]:
        """Everything buffered, as segments (long text still cut at `max_segment_chars`)."""
        out = self._cut()
        while self._buf:
            out.extend(self._take(len(self._buf)))
        self._last_append = None
        return out

    def deadline(self) -> float | None:
        """The time at which `poll` will cut the buffer, or None when nothing is pending."""
        if not self._buf or self._last_append is None:
            return None
        delay = self.sentence_delay_s if _LOOKS_FINISHED.search(self._buf) else self.max_delay_s
        return self._last_append + delay

    def poll(self, now: float) -> list[str]:
        deadline = self.deadline()
        if deadline is None or now < deadline:
            return []
        return self.flush()

    def _take(self, end: int, skip: int | None = None) -> list[str]:
        """Pop `_buf[:end]` as a segment (dropped if blank) and discard up to `skip`."""
        head = self._buf[:end].strip()
        self._buf = self._buf[end if skip is None else skip :].lstrip()
        if len(head) > self.max_segment_chars:
            rest = head
            out = []
            while len(rest) > self.max_segment_chars:
                cut = _cut_long(rest, self.max_segment_chars)
                out.append(rest[:cut].strip())
                rest = rest[cut:].strip()
            if rest:
                out.append(rest)
            return [s for s in out if s]
        return [head] if head else []

    def _cut(self) -> list[str]:
        out: list[str] = []
        while True:
            m = self._next_boundary()
            if m is None:
                break
            if m.group(1) is not None:
                out.extend(self._take(m.end(1), m.end()))
            elif m.group(3) is not None:
                out.extend(self._take(m.end(3)))
            else:
                out.extend(self._take(m.start(), m.end()))
        while len(self._buf) > self.max_segment_chars:
            cut = _cut_long(self._buf, self.max_segment_chars)
            out.extend(self._take(cut))
        return out

    def _next_boundary(self) -> re.Match | None:
        for m in _BOUNDARY.finditer(self._buf):
            single_dot = m.group(1) is not None and m.group(1).rstrip(_CLOSERS) == "."
            if single_dot and _is_abbreviation(self._buf[: m.start()]):
                continue
            return m
        return None
