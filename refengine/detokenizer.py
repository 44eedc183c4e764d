"""Incremental detokenization: token ids in, streamable text out, stop strings found.

Why not decode each new token alone: byte-level BPE splits one character over several
tokens (an emoji is often 3-4 tokens; each alone decodes to U+FFFD), and SentencePiece-style
decoders drop the leading space of the first token of whatever they decode. So, as vLLM
and TGI do, we decode a short *window* of tokens that ends with the new ones, decode the
same window without the new ones, and take the difference of the two strings:

    tokens:   ... | prefix_offset ......... read_offset ......... end
                    └── already emitted ──┘ └─ pending (new) ──┘
    new text = decode(tokens[prefix_offset:end]) - decode(tokens[prefix_offset:read_offset])

The pending tokens are held while their decode ends in U+FFFD (a character still
incomplete), then both offsets move forward. Each step decodes a few tokens, never the
whole output. The window starts up to 5 tokens into the prompt so the first generated
token is decoded in context (vLLM's ``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET``).

Stop strings are searched only where a new match can be: from ``len(stop) - 1``
characters before the new text to its end.

Known limit (shared with vLLM): tokens whose decode keeps ending in U+FFFD (a model
emitting invalid UTF-8) stay pending, and the window grows, until a whole character
arrives or ``finish`` flushes them. ``get_delta`` additionally holds back any tail
of the text that could still grow into a stop string, so a client never sees text that
is later cut.
"""

from __future__ import annotations

from typing import Protocol

from refengine.sampling_params import SamplingParams

# How many prompt tokens the first decode window reaches back (vLLM uses 5 too).
INITIAL_PREFIX_TOKENS = 5
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    """Streams one sequence's output text as tokens arrive.

    Args:
        tokenizer: anything with ``decode(ids: list[int], skip_special_tokens: bool) -> str``.
        prompt_token_ids: the prompt; only its last ``INITIAL_PREFIX_TOKENS`` are kept, as
            decoding context for the first output tokens.
        params: reads ``stop`` (via ``stop_strings``), ``include_stop_str_in_output``,
            ``skip_special_tokens`` and ``min_tokens`` (no stop string is searched for
            while fewer output tokens exist; a match must end in text added after that).

    Use: per generated token ``stop = d.add_token(t)``; then ``d.get_delta()`` for the
    text to stream; when the request ends for any reason other than a stop string,
    ``d.finish()`` for the rest. Invariant: the concatenation of every ``get_delta()`` and
    ``finish()`` equals ``d.text``, which equals the decode of the output tokens cut at the
    stop string (for a tokenizer whose decode of a concatenation is the concatenation of
    decodes at character boundaries, e.g. byte-level BPE).

    Attributes:
        text: the output text so far: only whole characters (pending incomplete ones are
            not in it until they complete or ``finish`` flushes them), cut at the stop
            string when one matched.
        output_token_ids: every token passed to ``add_token`` before a stop string matched
            (and the one that completed it).
        stop_string: the matched stop string, or None.
        finished: True after a stop string matched or ``finish()`` was called; then
            ``add_token`` ignores its token and returns None.
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop_strings = list(params.stop_strings)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens

        # The prompt's last few tokens (decoding context), then every output token.
        self._tokens = [int(t) for t in prompt_token_ids[-INITIAL_PREFIX_TOKENS:]]
        self._num_prompt = len(self._tokens)
        self._prefix_offset = 0
        self._read_offset = self._num_prompt
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        if self._prefix_text.endswith(_REPLACEMENT):
            # A prompt given as raw ids may end inside a character; its dangling bytes must
            # not merge with the output's, so decode the output without that context.
            self._prefix_offset, self._prefix_text = self._read_offset, ""

        self.text = ""
        self._emitted = 0  # characters of ``text`` already returned by get_delta/finish
        self.stop_string: str | None = None
        self.finished = False

    @property
    def output_token_ids(self) -> list[int]:
        return self._tokens[self._num_prompt:]

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self.tokenizer.decode(self._tokens[start:end], skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Append one generated token; return the stop string it completed, else None.

        On a match ``text`` is cut just before the stop string (just after it with
        ``include_stop_str_in_output``), whatever followed in the same token is dropped,
        and the detokenizer is finished. Of several stop strings the one that starts
        earliest wins (ties: the first in ``params.stop``).
        """
        if self.finished:
            return None
        self._tokens.append(int(token_id))
        window_text = self._decode(self._prefix_offset, len(self._tokens))
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT):
            return None  # nothing new yet, or a character still incomplete: wait
        new_text = window_text[len(self._prefix_text):]
        # Move the window: what was pending is now the decoded context.
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return self._append_text(new_text)

    def _append_text(self, new_text: str) -> str | None:
        old_len = len(self.text)
        self.text += new_text
        if not self.stop_strings or len(self._tokens) - self._num_prompt < self.min_tokens:
            return None  # like EOS, stop strings count only once min_tokens are out
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            # A new match must end inside the new text, so it starts at most len-1 before it.
            i = self.text.find(stop, max(old_len - len(stop) + 1, 0))
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return None
        i, stop = best
        self.text = self.text[: i + len(stop)] if self.include_stop_str_in_output else self.text[:i]
        self.stop_string = stop
        self.finished = True
        return stop

    def _held_back(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop_strings:
            for k in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def get_delta(self) -> str:
        """Text added since the previous ``get_delta``/``finish`` that is safe to stream.

        Excludes a pending incomplete character (never a trailing U+FFFD from a split
        UTF-8 sequence) and, while running, any tail that could begin a stop string.
        After a stop string matched, returns everything left (the text is final).
        """
        end = len(self.text) if self.finished else len(self.text) - self._held_back()
        end = max(end, self._emitted)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta

    def finish(self) -> str:
        """End of the request (EOS, length, abort): flush and return everything not yet
        streamed, including a trailing incomplete character (as U+FFFD, as a full decode
        of the output would show it). The flushed characters are still searched for stop
        strings (check ``stop_string`` afterwards if the finish reason matters). Idempotent; after a stop-string match it only returns
        what ``get_delta`` has not."""
        if not self.finished:
            pending = self._decode(self._prefix_offset, len(self._tokens))
            self._prefix_offset = self._read_offset = len(self._tokens)
            if len(pending) > len(self._prefix_text):
                self._append_text(pending[len(self._prefix_text):])
            self._prefix_text = ""
            self.finished = True
        delta = self.text[self._emitted:]
        self._emitted = len(self.text)
        return delta
