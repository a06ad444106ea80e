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
"""
from __future__ import annotations

from typing import Callable

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
        if longer.endswith(_INCOMPLETE) and end - self._read <= MAX_UNSETTLED:
            # settle up to the last complete character: it began at most 3 tokens back
            for cut in range(end - 1, max(self._read, end - 4), -1):
                part = self._decode(self.ids[self._context : cut])
                if not part.endswith(_INCOMPLETE):
                    self._settle(window, part, cut)
                    window = part
                    break
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
