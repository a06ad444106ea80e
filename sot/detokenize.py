"""Text of a growing list of tokens, decoded in time that does not grow with its length.

Decoding the whole answer again after every step costs time in proportion to its length, so
an answer of n tokens costs O(n^2) in all: about a second per 4,000 tokens with the default
tokenizer, paid by the engine for every request with stop strings and by the server for
every stream. :class:`IncrementalText` decodes only the new tokens, with the tokens of the
previous extension before them as context: their text is what decoding ``context + new``
adds to decoding ``context``. The context gives the tokenizer what it looks at across a
boundary (a SentencePiece word's leading space); it always begins on a whole character, as
byte-fallback decoders (Llama, Gemma) turn a whole run of byte tokens into replacement
characters when it begins or ends inside one. Text ending in an incomplete character waits
for the character's last token before it is settled. A tokenizer that rewrites text across
the boundary (a clean-up rule such as " ." to ".") makes it decode the whole list once.

:class:`TextAssembler` builds on it what a stream shows: text deltas that end before a stop
string and hold back what could still begin one (``SoT.stream``, ``AsyncSoT`` and the server).
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Callable

#: tokens left unsettled at most (a character takes at most 4 byte tokens)
MAX_UNSETTLED = 16

_INCOMPLETE = "\ufffd"


class IncrementalText:
    """The text of ``ids`` as tokens are appended.

    Text is *settled* up to a token where the decoded text is complete (it does not end in a
    replacement character); settled text is final. The tokens after it are decoded with the
    settled tokens of the last extension before them as context, so each extension decodes
    only the tokens it adds and those.

    Args:
        decode: token ids to text (a tokenizer's ``decode`` with the caller's settings, such
            as ``skip_special_tokens=True``).
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._settled = ""  # the text of ids[:_read]
        self._context = 0  # ids[_context:_read]: the tokens decoded before the new ones
        self._read = 0  # tokens whose text is settled
        self._tail = ""  # what ids[_read:] add so far (ends in a replacement character)

    def extend(self, ids: list[int]) -> None:
        """Append ``ids`` and decode what they add."""
        if not ids:
            return
        self.ids.extend(ids)
        window = self._decode(self.ids[self._context : self._read]) if self._context < self._read else ""
        longer = self._decode(self.ids[self._context :])
        end = len(self.ids)
        if longer.endswith(_INCOMPLETE):
            # settle up to the last complete character: it began at most 3 tokens back
            for cut in range(end - 1, max(self._read, end - 4), -1):
                part = self._decode(self.ids[self._context : cut])
                if not part.endswith(_INCOMPLETE):
                    self._settle(window, part, cut)
                    window = part
                    break
            if end - self._read <= MAX_UNSETTLED:  # else bytes that never complete: settle them
                self._tail = longer[len(window):] if longer.startswith(window) else _INCOMPLETE
                return
        self._settle(window, longer, end)
        self._tail = ""

    def _settle(self, window: str, longer: str, end: int) -> None:
        """Settle ``ids[:end]``, whose text from ``_context`` is ``longer``."""
        if longer.startswith(window):
            self._settled += longer[len(window):]
        else:  # the tokenizer rewrote text across the boundary (a clean-up rule): start over
            self._settled = self._decode(self.ids[:end])
        self._context, self._read = self._read, end

    @property
    def text(self) -> str:
        """``decode(ids)``: the settled text and what the unsettled tokens decode to."""
        return self._settled + self._tail if self._tail else self._settled

    @property
    def settled_length(self) -> int:
        """Characters of :attr:`text` that later tokens cannot change."""
        return len(self._settled)

    def __len__(self) -> int:
        """Characters of :attr:`text`, without building it."""
        return len(self._settled) + len(self._tail)


def decoder(tokenizer: Any, skip_special: bool = True) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` with ``skip_special_tokens`` fixed: what :class:`IncrementalText`
    takes."""
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special)
    return decode


class TextAssembler:
    """Turns a request's committed tokens into text deltas.

    The text is decoded incrementally (:class:`~sot.detokenize.IncrementalText`), so an update
    costs the same early and late in a long answer. A stop string ends the text before it;
    while the request runs, text that might begin a stop string and an incomplete character
    at the end are held back until the next tokens decide them. With ``min_tokens``, a stop
    string counts only where it ends in the text of a later token, as the engine (and vLLM)
    check stop strings only from then on; ``marks`` end the text from the first token (the
    opening of a tool call)."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), include_stop: bool = False,
                 skip_special: bool = True, min_tokens: int = 0, marks: tuple[str, ...] = ()) -> None:
        self.stop = stop + marks
        self.include_stop = include_stop  # the text ends after the stop string, not before it
        self._decoded = IncrementalText(decoder(tokenizer, skip_special))
        self._longest_stop = max((len(s) for s in self.stop), default=0)
        self._min_tokens = min_tokens
        self._stops, self._marks = stop, marks
        # a stop string counts where it ends past this many characters: the text of the first
        # min_tokens tokens (unknown, so nothing counts, until they are in)
        self._floor = 0 if min_tokens == 0 else None
        self.sent = 0
        self.text = ""
        self._ids: list[int] = []

    @property
    def ids(self) -> list[int]:
        """Every token added so far."""
        return self._ids

    def add(self, token_ids: list[int], final: bool, textless: int = 0) -> str:
        """The new text after ``token_ids``; ``final`` releases everything held back. The last
        ``textless`` of them add no text (an answer's stop token, as vLLM leaves it out)."""
        first = len(self._ids)
        self._ids.extend(token_ids)
        with_text = token_ids[: len(token_ids) - textless]
        if self._floor is None and len(self._ids) >= self._min_tokens:
            head = self._min_tokens - first  # the first min_tokens tokens end inside this update
            self._decoded.extend(with_text[:head])
            self._floor = len(self._decoded)
            with_text = with_text[head:]
        self._decoded.extend(with_text)
        text = self._decoded.text
        # what was sent holds no stop string and ends in none's beginning: look past it only
        found = self._first_stop(text, max(0, self.sent - self._longest_stop))
        cut, stopped = (found[0], True) if found is not None else (len(text), False)
        if stopped and self.include_stop:
            cut += len(found[1])
        if not final and not stopped:
            cut = min(cut, self._decoded.settled_length)  # an incomplete character waits
            for s in self.stop:  # the longest tail that could still grow into a stop string
                for k in range(min(len(s) - 1, cut), 0, -1):
                    if text[cut - k : cut] == s[:k]:
                        cut -= k
                        break
        self.text = text[:cut] if (final or stopped) else text
        delta = text[self.sent : cut] if cut > self.sent else ""
        self.sent = max(self.sent, cut)
        return delta

    def _first_stop(self, text: str, start: int) -> tuple[int, str] | None:
        """The earliest stop string in ``text[start:]`` that counts, as (index, string)."""
        found = [f for f in (first_stop(text, self._marks, start),
                             None if self._floor is None else first_stop(text, self._stops, start, self._floor))
                 if f is not None]
        return min(found, default=None)

    def final_text(self) -> str:
        return self.text[: self.sent] if self.sent <= len(self.text) else self.text


def first_stop(text: str, stops: tuple[str, ...], start: int = 0, floor: int = 0) -> tuple[int, str] | None:
    """The earliest of ``stops`` in ``text[start:]`` that ends past character ``floor`` (the
    text of an answer's first ``min_tokens`` tokens, where no stop string counts), as
    ``(index, string)``; ``None`` when there is none."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(start, floor - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def token_pieces(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's share of ``decode(ids)`` (special tokens kept), so the pieces join to the
    whole text: a character that spans several byte tokens (an emoji, most CJK characters
    in byte-level vocabularies) belongs to the token that completes it, and the tokens before
    it get ``""``. The last token also takes any text still unsettled at the end."""
    text = IncrementalText(decoder(tokenizer, skip_special=False))
    pieces, done = [], 0
    for t in ids:
        text.extend([t])
        settled = text.settled_length
        pieces.append(text.text[done:settled])
        done = settled
    if pieces and len(text) > done:
        pieces[-1] += text.text[done:]
    return pieces


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback token


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """The character that stands for each byte in a byte-level BPE token (GPT-2's scheme:
    printable Latin-1 bytes stand for themselves, the others for characters from U+0100 on)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    alphabet, moved = {}, 0
    for b in range(256):
        if b in kept:
            alphabet[chr(b)] = b
        else:
            alphabet[chr(256 + moved)] = b
            moved += 1
    return alphabet


def token_bytes(tokenizer: Any, token: int, text: str) -> bytes:
    """The bytes of one token, OpenAI's ``bytes`` field: ``text`` (the token decoded alone) in
    UTF-8, or, where the token holds only part of a character (``text`` then shows a
    replacement character), the raw bytes its byte-level or byte-fallback piece stands for,
    so that the bytes of consecutive tokens join to the answer's UTF-8."""
    if "\ufffd" not in text:
        return text.encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(token)
    match = _BYTE_TOKEN.fullmatch(piece or "")
    if match:
        return bytes([int(match.group(1), 16)])
    alphabet = _byte_level_alphabet()
    if piece and all(c in alphabet for c in piece):
        return bytes(alphabet[c] for c in piece)
    return text.encode("utf-8")


def token_label(tokenizer: Any, token: int) -> str:
    """A token's text for a person to read: its decoded text, or, for a token that holds only
    part of a character (decoding gives U+FFFD), its bytes (:func:`token_bytes`) with those
    that do not decode written as ``\\xf0`` escapes, so that two such tokens never read alike."""
    text = tokenizer.decode([token])
    if _INCOMPLETE not in text:
        return text
    return token_bytes(tokenizer, token, text).decode("utf-8", errors="backslashreplace")
