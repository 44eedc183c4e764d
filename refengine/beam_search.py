"""Beam search on top of the engine: vLLM's ``LLM.beam_search`` API, transformers' rule.

As in vLLM, beam search is a loop *around* the engine: each step, every live beam is
sent as a one-token request whose prompt is the beam so far, asking for the top ``K``
log-probabilities of the next token. The beams of a prompt share their prefix through
the prefix cache: a beam's request finds the full blocks its parent's request filled one
step earlier, so it computes at most ``block_size`` tokens (with prefix caching off,
every step recomputes every beam from the start: correct, but slow).

The selection rule is transformers' (``GenerationMixin._beam_search``, transformers
5.x), so the beams equal ``generate(num_beams=W, do_sample=False, length_penalty=...,
early_stopping=...)``. Each step, for each prompt:

1. Candidates: every live beam extended by each of its ``K = W + E`` most likely next
   tokens (``E`` EOS ids; none with ``ignore_eos``), ranked by cumulative log-probability
   (the sum of the raw log-softmax of each chosen token). transformers ranks the top
   ``max(2, 1 + E) * W`` of all beams' candidates together; the first ``W`` non-ending
   candidates of that ranking and the ending ones among its first ``W`` are what rules 2-3
   use, and each of those is among its own beam's top ``W + E`` (above it in its beam rank
   at most ``W - 1`` non-ending candidates and ``E`` EOS ones), so the beams are the same
   while each step asks the engine for ``W + E`` logprobs, not ``2W`` or more: within
   the default ``max_logprobs=20`` up to width 19 with one EOS id (SmolLM2), 17 with
   Llama 3's three. A width that needs more than ``max_logprobs`` is refused before the
   search starts (:func:`beam_search`), naming both (vLLM asks for ``2W`` and its first
   step's request fails on ``max_logprobs``; the remedy is the same: a larger ``max_logprobs``).
2. A candidate *ends* when its token is an EOS id (unless ``ignore_eos``) or it has
   ``max_tokens`` generated tokens (or reached ``max_model_len``). An ending candidate
   ranked in the top ``W`` is scored ``cum_logprob / num_generated ** length_penalty``
   (``num_generated`` counts the EOS token) and kept if it is among the ``W`` best
   finished so far; ending candidates ranked lower are dropped.
3. The ``W`` best non-ending candidates are the next step's live beams.
4. The prompt is done when no beam is live, or once ``W`` beams have finished and
   ``early_stopping is True``; or (``early_stopping`` False) once ``W`` have finished and
   the best live beam's ``cum_logprob / t ** length_penalty`` (``t``: tokens generated
   so far) is no better than the worst finished score; ``"never"`` uses
   ``t = max_tokens`` in that bound when ``length_penalty > 0``.

Where vLLM (``vllm/entrypoints/llm.py``, ``beam_search``) differs, we follow transformers:
vLLM divides by the length of *prompt + output* excluding a final EOS; keeps every EOS
candidate of each beam's ``2W`` candidates as finished, not only those ranked in the top
``W``; never stops early (always ``max_tokens`` steps), and finally ranks the finished
and live beams together. vLLM's ``temperature`` is kept: at ``temperature > 0`` each beam
also proposes one token drawn at that temperature (scored by its raw log-probability),
so the search is no longer deterministic; transformers ignores temperature without
sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from refengine.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``, plus transformers' ``early_stopping``.

    Attributes:
        beam_width: beams kept per prompt (``num_beams``), >= 1.
        max_tokens: most tokens to generate per beam, >= 1.
        ignore_eos: EOS is an ordinary token (beams end only by length).
        temperature: 0 (deterministic); > 0 adds a sampled candidate per beam (vLLM).
        length_penalty: the exponent of the generated length in the score.
        early_stopping: True, False or "never", as transformers' (module docstring, rule 4).

    Raises:
        ValueError: a value out of range, naming it.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"BeamSearchParams.beam_width={self.beam_width!r} is invalid: must be an integer >= 1")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"BeamSearchParams.max_tokens={self.max_tokens!r} is invalid: must be an integer >= 1")
        if not self.temperature >= 0.0:
            raise ValueError(f"BeamSearchParams.temperature={self.temperature!r} is invalid: must be >= 0")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"BeamSearchParams.early_stopping={self.early_stopping!r} is invalid: "
                             "must be True, False or 'never'")


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's ``BeamSearchSequence``).

    Attributes:
        tokens: prompt + generated token ids (a final EOS included).
        num_prompt_tokens: how many of ``tokens`` are the prompt.
        cum_logprob: sum of the generated tokens' log-probabilities (natural log).
        score: ``cum_logprob / len(output_token_ids) ** length_penalty``, what beams are
            ranked by (transformers' ``sequences_scores``).
        text: ``tokens`` decoded, prompt included, as vLLM (None without a tokenizer).
        output_text: the generated tokens decoded (special tokens skipped).
        finish_reason: "stop" (EOS) or "length" (``max_tokens`` or ``max_model_len``).
    """

    tokens: list[int]
    num_prompt_tokens: int
    cum_logprob: float = 0.0
    score: float = 0.0
    text: str | None = None
    output_text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first (vLLM's ``BeamSearchOutput``)."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class _Search:
    """One prompt's search state."""

    max_new: int
    live: list[BeamSearchSequence]
    finished: list[BeamSearchSequence] = field(default_factory=list)  # best first, at most W
    done: bool = False


def beam_search(llm, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Run beam search for each prompt (token ids) through ``llm.generate``.

    Args:
        llm: a :class:`refengine.core.engine.LLM`.
        prompts: one list of token ids per prompt (each shorter than ``max_model_len``).
        params: the search parameters.
    Returns:
        Per prompt, ``beam_width`` beams best first.
    Raises:
        ValueError: ``beam_width`` plus the number of EOS ids (the logprobs each step
            needs, module docstring rule 1) is more than the engine's ``max_logprobs``;
            raised before any step runs, naming the width, the need and the limit.
    """
    engine = llm.llm_engine
    width, lp = params.beam_width, params.length_penalty
    eos = set() if params.ignore_eos else set(engine.eos_token_ids)
    k = width + len(eos)  # enough for transformers' rule (module docstring, rule 1)
    limit = engine.config.max_logprobs
    if k > limit:
        raise ValueError(f"BeamSearchParams.beam_width={width} needs logprobs={k} per step (the width plus "
                         f"{len(eos)} EOS id(s)), more than max_logprobs={limit}: use beam_width <= "
                         f"{limit - len(eos)} or raise the engine option max_logprobs to at least {k}")
    step_params = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=k, ignore_eos=True)
    max_len = engine.config.max_model_len
    searches = [_Search(min(params.max_tokens, max_len - len(p)), [BeamSearchSequence(list(p), len(p))])
                for p in prompts]
    step = 0
    while any(not s.done for s in searches):
        step += 1
        active = [s for s in searches if not s.done]
        beams = [b for s in active for b in s.live]
        outputs = llm.generate([b.tokens for b in beams], step_params, use_tqdm=False)
        proposals = iter(out.outputs[0].logprobs[0] for out in outputs)
        for s in active:
            candidates = [(b.cum_logprob + lp_tok, b, tok) for b in s.live for tok, lp_tok in next(proposals).items()]
            candidates.sort(key=lambda c: -c[0])  # stable: ties keep beam order, then token order
            last = step == s.max_new
            s.live = []
            for rank, (cum, parent, tok) in enumerate(candidates):
                if rank >= width and len(s.live) == width:
                    break  # later candidates can neither finish (rank >= W) nor live
                child = BeamSearchSequence(parent.tokens + [tok], parent.num_prompt_tokens, cum)
                if last or tok in eos:
                    if rank < width:
                        child.finish_reason = "stop" if tok in eos else "length"
                        child.score = cum / step ** lp
                        s.finished.append(child)
                elif len(s.live) < width:
                    s.live.append(child)
            s.finished.sort(key=lambda b: -b.score)
            del s.finished[width:]
            s.done = last or not s.live or _no_improvement(s, width, step, params)
    tokenizer = engine.tokenizer
    for s in searches:
        for b in s.finished:
            if tokenizer is not None:
                b.text = tokenizer.decode(b.tokens)
                b.output_text = tokenizer.decode(b.output_token_ids)
    return [BeamSearchOutput(s.finished) for s in searches]


def _no_improvement(s: _Search, width: int, step: int, params: BeamSearchParams) -> bool:
    """Rule 4: whether no live beam can beat the finished ones (transformers' heuristic)."""
    if len(s.finished) < width:
        return False
    if params.early_stopping is True:
        return True
    lp = params.length_penalty
    length = s.max_new if params.early_stopping == "never" and lp > 0 else step
    return s.live[0].cum_logprob / length ** lp <= s.finished[-1].score
