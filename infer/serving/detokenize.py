"""Incremental detokenization for the server's streams: each new token's text is found by
decoding a few tokens around it, never the whole answer again, so the host time per streamed
token stays flat as answers grow (before: every chunk decoded the request's whole answer, and
logprobs' text coverage was a bisection over more decodes: quadratic in the answer).

The text of tokens[:i] is the concatenation of deltas: a delta is the decode of a short window
(from `_prefix`, a token or more before the new one, so that a tokenizer whose decode of a
token depends on its left neighbour, a SentencePiece space or a merge, decodes it in context)
less the decode of the window without the new tokens. A token whose bytes end inside a
character (its decode ends with U+FFFD) adds nothing until the tokens that complete it arrive;
then they all add their text. `ends[i]` is the length of the text whose characters
tokens[:i+1] hold whole: the characters a token's logprobs cover, and the tokens an answer cut
at a stop string returned, by bisection over `ends` rather than over decodes.
"""

from __future__ import annotations

import bisect

REPLACEMENT = "\ufffd"  # what a decode of half a UTF-8 character ends with


class Detokenizer:
    """The text of a growing token sequence, decoded incrementally (`add`)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        self.tokens: list[int] = []
        self.text = ""
        self.ends: list[int] = []  # the characters tokens[: i + 1] hold whole
        self._prefix = 0  # the window's first token: context for the tokens after _read
        self._read = 0  # tokens whose text is in `text`

    def add(self, ids, final: bool = False) -> str:
        """Appends the tokens `ids`; -> the text they complete (possibly empty: half a
        character waits for the rest, unless `final`: the answer ends there)."""
        before = len(self.text)
        for t in ids:
            self.tokens.append(int(t))
            self.ends.append(self._read_window(force=False))
        if final and self._read < len(self.tokens):  # what waited, as the decode renders it
            self.ends[-1] = self._read_window(force=True)
        return self.text[before:]

    def _read_window(self, force: bool) -> int:
        """Moves the tokens past `_read` into `text` unless they end inside a character
        (and not `force`). -> the length of the text the tokens so far hold whole (past
        len(text) while the characters before a half one wait with it)."""
        window = self._decode(self.tokens[self._prefix :])
        done = self._decode(self.tokens[self._prefix : self._read])
        if window.endswith(REPLACEMENT) and not force:  # the whole characters it holds count
            return len(self.text) + len(window.rstrip(REPLACEMENT)) - len(done)
        self.text += window[len(done) :]
        self._prefix, self._read = self._read, len(self.tokens)
        return len(self.text)

    def tokens_for(self, chars: int) -> int:
        """The fewest leading tokens whose text holds the first `chars` characters."""
        return min(bisect.bisect_left(self.ends, chars) + 1, len(self.tokens)) if chars else 0
