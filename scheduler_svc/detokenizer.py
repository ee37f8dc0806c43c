"""Incremental detokenization with stop strings.

Decoding a token on its own is wrong for byte-level BPE (a character can span tokens, and a
token's leading space depends on its neighbour), so each step decodes a short window of recent
tokens and emits only the text that became stable. Text that might be the start of a stop string
is held back until it is clearly not one, so a stop string never reaches the client.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_tail: list[int], stop: tuple[str, ...] = ()):
        self._tok = tokenizer
        # A few prompt tokens give the first output token its left context (leading spaces).
        self._ids: list[int] = list(prompt_tail[-4:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""  # stable text decoded so far
        self._emitted = 0  # characters of _text already handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_ids: list[int], final: bool = False) -> str:
        """Add new tokens; return the text to send now. Sets `stopped` when a stop string appears."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        # A trailing U+FFFD means the last token ends inside a multi-byte character: wait.
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self._text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        return self._release(final)

    def _release(self, final: bool) -> str:
        if self._stop:
            search_from = max(0, self._emitted - self._hold)
            hits = [i for i in (self._text.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                self._text = self._text[: min(hits)]
                self.stopped = True
                final = True
        end = len(self._text) if final else max(self._emitted, len(self._text) - self._hold)
        out = self._text[self._emitted : end]
        self._emitted = end
        return out
