"""The stop rules, in one place: after each sampled token, does its sequence end, and why?

vLLM's semantics (``vllm/engine/output_processor/stop_checker.py``), checked in this order
for the token just appended:

0. No token (:data:`refengine.sampler.NO_TOKEN`: the request's masks left nothing to
   sample): ``finish_reason="error"`` (vLLM's ``FinishReason.ERROR``), nothing appended.
1. Fewer than ``min_tokens`` outputs: EOS, stop token ids and stop strings do not count
   (the sampler already bans EOS and stop ids then; a stop string must end in text added
   once ``min_tokens`` are out).
2. EOS (unless ``ignore_eos``): ``finish_reason="stop"``, ``stop_reason=None``.
3. A ``stop_token_ids`` entry: ``"stop"``, ``stop_reason=<the id>``.
   For 2 and 3 the token stays in ``token_ids``; its text is kept only with
   ``include_stop_str_in_output`` (EOS decodes to "" when ``skip_special_tokens``).
4. A stop string in the text: ``"stop"``, ``stop_reason=<the string>``; the text is cut
   before it (after it with ``include_stop_str_in_output``). Of several stop strings the
   match that **completes earliest in the text** wins (ties: the one that starts earlier),
   so the result never depends on how the same text was split into tokens.
5. ``max_model_len`` reached, then ``max_tokens`` reached: ``"length"``.

When a sequence ends for a reason other than a stop string, the detokenizer flushes any
incomplete trailing character; if that flushed text completes a stop string, the end
becomes that stop string's (``"stop"``), as it would have been had the bytes formed a
character earlier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from refengine.detokenizer import IncrementalDetokenizer
from refengine.sampler import NO_TOKEN

# ``Sequence`` (:mod:`refengine.core.sequence`) appears in annotations only, as a name: the core loop
# imports this module, never the other way round.


@dataclass(frozen=True)
class StopDecision:
    """Why a sequence ended: ``finish_reason`` ("stop", "length" or "error") and
    ``stop_reason`` (the stop string or token id that matched; None for EOS, length and
    error)."""

    finish_reason: str
    stop_reason: int | str | None = None


def find_stop_string(text: str, num_new_chars: int, stop_strings: Iterable[str]) -> tuple[int, str] | None:
    """The stop string whose match completes earliest inside the last ``num_new_chars`` of ``text``.

    Only matches that end in the new text count (earlier ones were checked before).

    Returns:
        ``(start index, stop string)``, or None. Ties on the end: the longer (earlier) match.
    """
    old_len = len(text) - num_new_chars
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop in stop_strings:
        # the first occurrence that can end in the new text is also the one that ends first
        i = text.find(stop, max(old_len - len(stop) + 1, 0))
        if i != -1 and (best is None or (i + len(stop), i) < best[:2]):
            best = (i + len(stop), i, stop)
    return None if best is None else (best[1], best[2])


class StopChecker:
    """Applies the stop rules to one sequence after each appended token.

    Args:
        eos_token_ids: the model's end-of-sequence ids (config, generation config, tokenizer).
        max_model_len: most tokens a sequence may hold.
    """

    def __init__(self, eos_token_ids: Iterable[int], max_model_len: int):
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_model_len = max_model_len

    def append_and_check(self, seq: Sequence, token: int) -> StopDecision | None:
        """Append ``token`` to ``seq`` (ids and text) and decide whether ``seq`` ends here.

        ``token`` :data:`NO_TOKEN` appends nothing and ends ``seq`` with "error".

        Returns:
            The decision, or None when ``seq`` goes on. The caller finishes the sequence.
        """
        params, detok = seq.sampling_params, seq.detokenizer
        if token == NO_TOKEN:
            decision = StopDecision("error")
            return self._flush(detok, seq, decision) if detok is not None else decision
        seq.output_token_ids.append(token)
        may_stop = seq.num_output_tokens >= params.min_tokens
        decision = None
        if may_stop and not params.ignore_eos and token in self.eos_token_ids:
            decision = StopDecision("stop")
        elif may_stop and token in params.stop_token_id_set:
            decision = StopDecision("stop", token)
        if detok is not None and (decision is None or params.include_stop_str_in_output):
            new_text = detok.add_token(token)
            if decision is None and may_stop and new_text and params.stop_strings:
                decision = self._match_stop_string(detok, len(new_text), params)
        if decision is None and (len(seq) >= self.max_model_len
                                 or (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens)):
            decision = StopDecision("length")
        if decision is not None and detok is not None and not isinstance(decision.stop_reason, str):
            decision = self._flush(detok, seq, decision)
        return decision

    @staticmethod
    def _match_stop_string(detok: IncrementalDetokenizer, num_new_chars: int, params) -> StopDecision | None:
        match = find_stop_string(detok.text, num_new_chars, params.stop_strings)
        if match is None:
            return None
        start, stop = match
        detok.truncate(start + len(stop) if params.include_stop_str_in_output else start)
        return StopDecision("stop", stop)

    def _flush(self, detok: IncrementalDetokenizer, seq: Sequence, decision: StopDecision) -> StopDecision:
        """End of the sequence for EOS, a stop id or length: flush an incomplete trailing
        character; a stop string it completes decides the end."""
        flushed = detok.flush()
        params = seq.sampling_params
        if flushed and params.stop_strings and seq.num_output_tokens >= params.min_tokens:
            matched = self._match_stop_string(detok, len(flushed), params)
            if matched is not None:
                return matched
        return decision
