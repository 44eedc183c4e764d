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

Stop strings are matched by :mod:`refengine.stop` on ``text``; this class only holds back
a streamed tail that could still grow into one, and cuts ``text`` when told.

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
        params: reads ``stop`` (via ``stop_strings``, for the hold-back) and ``skip_special_tokens``.

    Use: per generated token ``new_text = d.add_token(t)`` (the stop checker searches
    ``d.text`` and may :meth:`truncate` it); then ``d.get_delta()`` for the text to stream;
    at the end :meth:`flush` (or :meth:`finish`, which also returns the rest). Invariant:
    the concatenation of every ``get_delta()`` equals ``d.text``, which equals the decode of
    the output tokens, cut where a stop string matched (for a tokenizer whose decode of a
    concatenation is the concatenation of decodes at character boundaries, e.g. byte-level BPE).

    Attributes:
        text: the output text so far: only whole characters (pending incomplete ones are
            not in it until they complete or ``finish`` flushes them), cut at the stop
            string when one matched.
        output_token_ids: every token passed to ``add_token`` before it finished.
        finished: True after :meth:`truncate` or :meth:`flush`; then ``add_token`` ignores
            its token and returns "".
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop_strings = list(params.stop_strings)

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
        self._emitted = 0  # characters of ``text`` already returned by get_delta
        self.finished = False

    @property
    def output_token_ids(self) -> list[int]:
        return self._tokens[self._num_prompt:]

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self.tokenizer.decode(self._tokens[start:end], skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the text it completed and appended to ``text``
        ("" while a character is still incomplete, or once finished: the token is ignored)."""
        if self.finished:
            return ""
        self._tokens.append(int(token_id))
        window_text = self._decode(self._prefix_offset, len(self._tokens))
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT):
            return ""  # nothing new yet, or a character still incomplete: wait
        new_text = window_text[len(self._prefix_text):]
        # Move the window: what was pending is now the decoded context.
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self.text += new_text
        return new_text

    def truncate(self, length: int) -> None:
        """Cut ``text`` to its first ``length`` characters (a stop string matched, see
        :mod:`refengine.stop`) and finish: later tokens are ignored."""
        self.text = self.text[:length]
        self.finished = True

    def _held_back(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop_strings:
            for k in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def checkpoint(self) -> tuple:
        """The whole state, for :meth:`rollback` (O(1): tokens are only appended)."""
        return (len(self._tokens), self._prefix_offset, self._read_offset, self._prefix_text, self.text,
                self._emitted, self.finished)

    def rollback(self, checkpoint: tuple) -> None:
        """Return to the state :meth:`checkpoint` saw (a failed step is undone)."""
        (num_tokens, self._prefix_offset, self._read_offset, self._prefix_text, self.text,
         self._emitted, self.finished) = checkpoint
        del self._tokens[num_tokens:]

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

    def flush(self) -> str:
        """End of the output: append the pending tokens' text, including a trailing incomplete
        character (as U+FFFD, as a full decode of the output would show it), and finish.

        Returns:
            The text this appended ("" if nothing was pending or already finished).
        """
        if self.finished:
            return ""
        pending = self._decode(self._prefix_offset, len(self._tokens))
        self._prefix_offset = self._read_offset = len(self._tokens)
        flushed = pending[len(self._prefix_text):] if len(pending) > len(self._prefix_text) else ""
        self._prefix_text = ""
        self.text += flushed
        self.finished = True
        return flushed

    def finish(self) -> str:
        """:meth:`flush`, then return everything not yet streamed. Idempotent."""
        self.flush()
        return self.get_delta()
