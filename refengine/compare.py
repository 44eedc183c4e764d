"""``refengine compare``: refengine's predictions against transformers', or against a golden file.

What is compared, per prompt (:func:`score`):

1. The **sequence scored** is the prompt's token ids (the reference's tokenization) followed
   by the reference's greedy continuation of ``max_tokens`` tokens (EOS ignored), so both
   sides see the same tokens. Its ``S`` positions each give one row of log-probabilities:
   row ``i`` is ``log_softmax(logits)`` after token ``i`` (it predicts token ``i + 1``; the
   last row predicts past the sequence). Log-probabilities, not raw logits: they do not
   depend on a constant added to every logit, and they are what an OpenAI-compatible
   server returns.
2. **max |Δlogprob|**: the largest ``|logprob_test - logprob_ref|`` over every row, taken
   over the reference's top-k tokens of that row and the token that follows in the
   sequence (the same tokens whichever way the reference was stored).
3. **argmax differs**: rows whose most likely token differs. A row counts against the
   tolerance only if the reference's margin between its top token and the test's top token
   exceeds ``flip_margin``; below that it is a near-tie that errors within the bound can flip.
4. **mean KL**: ``KL(ref || test)`` in nats, averaged over the rows. With full rows on both
   sides (transformers in this process) it is exact over the whole vocabulary. Against a
   golden file (top-k stored) it is the **top-k + rest estimator**: the distributions are
   coarsened to ``k + 1`` buckets, the reference's top-k tokens (those the test side
   reports) and one "rest" bucket holding the remaining mass (``1 - sum``) of each; by the
   data-processing inequality this is a lower bound of the full KL.
5. **greedy**: the test side's own greedy continuation of the prompt (its decode path)
   against the reference's, and the first position where they diverge, both tokens decoded.
   A divergence counts against the tolerance under the same margin rule as 3.
6. **tokens**: the test side's own tokenization of the prompt (and chat template) against
   the reference's ids; any difference fails.

Tolerances (:data:`TOLERANCES`, :func:`tolerance_for`) depend on refengine's dtype,
weight quantization and KV cache dtype, and are printed with every run.

Golden files (:func:`save_golden`, :func:`load_golden`, docs/compare.md): JSON holding the
reference per prompt (token ids, greedy continuation, top-k ids and log-probabilities per
row, the log-probability of each next token), the decoded text of every id it mentions,
the library versions and the sha256 of the model files. Checking against one needs neither
torch nor transformers.

Servers (:func:`engine_url_observation`): ``POST {url}/completions`` with the sequence's
ids as prompt, ``echo``, ``logprobs=k``, ``max_tokens=1``, temperature 0, then the prompt
alone for the greedy continuation. Top-logprob entries are matched to ids by the server's
``token_id:N`` keys where it gives them, else by decoded text (texts that several of the
reference's ids share are left out); each echoed token's own log-probability is matched by
position, so by id.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import click
import numpy as np

from refengine.cli_options import TEXT, engine_from_args, engine_options, fail
from refengine.engine_args import EngineArgs
from refengine.eval.perplexity import kl_divergence, log_softmax

GOLDEN_FORMAT = "refengine-golden"
GOLDEN_VERSION = 1
DEFAULT_TOP_K = 20
DEFAULT_MAX_TOKENS = 16
ROW_BLOCK = 128  # rows log-softmaxed at once (float64 scratch of ROW_BLOCK * vocab)
LONG_PROMPT_MIN = 320  # tokens of the long prompt for a model without a sliding window


# --- prompts ----------------------------------------------------------------------------------

@dataclass
class PromptSpec:
    """One prompt: a text (tokenized with the tokenizer's special tokens, as a text prompt of
    ``refengine generate``) or chat ``messages`` (rendered by the chat template with the
    generation prompt, tokenized without extra special tokens)."""

    name: str
    text: str | None = None
    messages: list[dict] | None = None

    def to_dict(self) -> dict:
        return {"name": self.name, "text": self.text} if self.messages is None else \
            {"name": self.name, "messages": self.messages}


BUILTIN = [
    PromptSpec("chat", messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]),
    PromptSpec("code", text="def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n"),
    PromptSpec("digits", text="3.14159265358979 + 2.718281828 = 5.85987448; 1,234,567 x 89 = 109876463; 0x1F = 31"),
    PromptSpec("cjk", text="東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다。"),
    PromptSpec("emoji", text="Weather: ☀️🌧️❄️ Mood: 😀🎉👍🏽 Family: 👨‍👩‍👧‍👦 Flags: 🇫🇷🇯🇵"),
]


def long_prompt(encode, num_tokens: int) -> PromptSpec:
    """``long``: the start of the corpus shipped with ``refengine bench``, cut at a word so
    that ``encode`` gives at least ``num_tokens`` ids (fewer only if the corpus runs out).

    Args:
        encode: text -> token ids (the reference's tokenizer, special tokens added).
    """
    from refengine.bench.workload import load_corpus

    words = load_corpus().split(" ")
    lo, hi = 1, len(words)  # the fewest words that give num_tokens ids
    while lo < hi:
        mid = (lo + hi) // 2
        if len(encode(" ".join(words[:mid]))) >= num_tokens:
            hi = mid
        else:
            lo = mid + 1
    return PromptSpec("long", text=" ".join(words[:lo]))


def default_prompts(encode, *, has_chat_template: bool, sliding_window: int | None, max_len: int) -> list[PromptSpec]:
    """The built-in set: chat (when the tokenizer has a chat template), code, digits, CJK,
    emoji, and ``long``: ``sliding_window + 64`` tokens (at least :data:`LONG_PROMPT_MIN`),
    capped at ``max_len`` (what the sequence may hold before the continuation)."""
    specs = [p for p in BUILTIN if p.messages is None or has_chat_template]
    target = min(max((sliding_window or 0) + 64, LONG_PROMPT_MIN), max_len)
    return specs + [long_prompt(encode, target)]


# --- the reference, and what is observed against it -------------------------------------------

@dataclass
class Reference:
    """The reference of one prompt (from transformers, or read from a golden file).

    Attributes:
        prompt: the prompt as given.
        prompt_ids: its token ids; ``sequence`` = ``prompt_ids + continuation_ids`` (``S`` ids).
        continuation_ids: the reference's greedy continuation (EOS ignored).
        top_ids: ``[S, k]`` int64, each row's k most likely ids, most likely first (ties: lower id first).
        top_logprobs: ``[S, k]`` float64, their log-probabilities (nats).
        next_logprobs: ``[S - 1]`` float64, row ``i``'s log-probability of ``sequence[i + 1]``.
        logprobs: ``[S, vocab]`` float32 full rows, only while transformers runs in this process.
    """

    prompt: PromptSpec
    prompt_ids: list[int]
    continuation_ids: list[int]
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    next_logprobs: np.ndarray
    logprobs: np.ndarray | None = None

    @property
    def sequence(self) -> list[int]:
        return self.prompt_ids + self.continuation_ids

    @classmethod
    def from_logprobs(cls, prompt: PromptSpec, prompt_ids, continuation_ids, logprobs: np.ndarray,
                      top_k: int) -> "Reference":
        seq = list(prompt_ids) + list(continuation_ids)
        top_ids, top_lp = top_k_rows(logprobs, top_k)
        nxt = logprobs[np.arange(len(seq) - 1), seq[1:]].astype(np.float64)
        return cls(prompt, list(prompt_ids), list(continuation_ids), top_ids, top_lp, nxt, logprobs)


@dataclass
class Observation:
    """What the side under test gave for one reference's sequence.

    Attributes:
        prompt_ids: its own tokenization of the prompt (None: not known, e.g. a server given ids).
        continuation_ids: its own greedy continuation of ``prompt_ids`` (None: only texts known).
        continuation_texts: the continuation's tokens as text, where ids are not known.
        logprobs: ``[S, vocab]`` float32 full rows (refengine in this process), or None;
        sparse: per row, ``{id: logprob}`` of the ids it reported (a server), or None.
        top_ids: per row, the id of its most likely token where known (a server: None where
            its text is not one of the reference's ids', or where texts the reference's ids
            share hide which was most likely).
        top_texts: per row, the text of its most likely token where it is none of the
            reference's ids (then it is not the reference's most likely token either).
    """

    prompt_ids: list[int] | None
    continuation_ids: list[int] | None
    logprobs: np.ndarray | None = None
    sparse: list[dict[int, float]] | None = None
    top_ids: list[int | None] | None = None
    top_texts: list[str | None] | None = None
    continuation_texts: list[str] | None = None

    def values(self, row: int, ids: np.ndarray) -> np.ndarray:
        """Log-probabilities of ``ids`` at ``row`` (nan where not reported)."""
        if self.logprobs is not None:
            return self.logprobs[row, ids].astype(np.float64)
        entry = self.sparse[row] if row < len(self.sparse) else {}
        return np.array([entry.get(int(t), np.nan) for t in ids], dtype=np.float64)

    def argmax(self, row: int) -> int | None:
        """The id of the row's most likely token (None: not known by id, or no row)."""
        if self.logprobs is not None:
            return int(self.logprobs[row].argmax())
        return self.top_ids[row] if self.top_ids is not None and row < len(self.top_ids) else None

    def has_row(self, row: int) -> bool:
        return self.logprobs is not None or (row < len(self.sparse) and bool(self.sparse[row]))


def top_k_rows(logprobs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``[S, V]`` -> (``[S, k]`` int64 ids, ``[S, k]`` float64 values), most likely first,
    ties broken by the lower id."""
    k = min(k, logprobs.shape[1])
    part = np.argpartition(-logprobs, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(logprobs, part, axis=1)
    order = np.lexsort((part, -vals), axis=1)
    ids = np.take_along_axis(part, order, axis=1).astype(np.int64)
    return ids, np.take_along_axis(logprobs, ids, axis=1).astype(np.float64)


def logprob_rows(logits: np.ndarray) -> np.ndarray:
    """``[S, V]`` logits -> ``[S, V]`` float32 log-softmax (computed in float64 by row blocks)."""
    out = np.empty(logits.shape, dtype=np.float32)
    for i in range(0, len(logits), ROW_BLOCK):
        out[i:i + ROW_BLOCK] = log_softmax(logits[i:i + ROW_BLOCK])
    return out


# --- tolerances -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tolerance:
    """The bounds a run must stay within.

    Attributes:
        label: which setting they are for.
        max_abs_dlogprob: bound on max |Δlogprob| (None: not bounded, a lossy setting is judged by KL).
        mean_kl: bound on the mean KL(ref || test) per prompt, nats.
        flip_margin: an argmax or greedy difference fails only where the reference's margin
            between the two tokens exceeds this (nats).
    """

    label: str
    max_abs_dlogprob: float | None
    mean_kl: float
    flip_margin: float

    def describe(self) -> str:
        parts = []
        if self.max_abs_dlogprob is not None:
            parts.append(f"max |Δlogprob| <= {self.max_abs_dlogprob:g}")
        parts.append(f"mean KL <= {self.mean_kl:g} nats")
        parts.append(f"argmax/greedy differences only where the reference's margin <= {self.flip_margin:g}")
        return f"tolerances ({self.label}): " + "; ".join(parts)


#: float32 against transformers in float32 differs by summation order only: the existing
#: golden tests hold logits within 1e-3 (SmolLM2) and 1e-4 relative (tiny models), and this
#: command measures ~5e-5 |Δlogprob| on SmolLM2. "lossy" from int8 on SmolLM2 (mean KL up
#: to 8e-3). float16/bfloat16 run on a GPU only and are provisional (docs/compare.md).
TOLERANCES = {
    "float32": Tolerance("float32", 1e-3, 1e-5, 2e-3),
    "float16": Tolerance("float16 weights and KV cache", 0.1, 2e-3, 0.2),
    "bfloat16": Tolerance("bfloat16 weights and KV cache", 0.25, 1e-2, 0.5),
    "lossy": Tolerance("quantized weights or KV cache", None, 5e-2, 1.0),
}


def tolerance_for(dtype: str, quantization: str | None, kv_cache_dtype: str) -> Tolerance:
    """The tolerances for refengine running in ``dtype`` (a resolved name: float32, float16,
    bfloat16) with weight ``quantization`` (None, int8, awq, gptq) and ``kv_cache_dtype``
    (auto, float16, int8, fp8_*). A GGUF file run as stored counts as float32: transformers
    dequantizes the same blocks."""
    if quantization is not None or kv_cache_dtype not in ("auto", dtype):
        return TOLERANCES["lossy"]
    return TOLERANCES[dtype]


# --- scoring ----------------------------------------------------------------------------------

@dataclass
class PromptReport:
    """The comparison of one prompt (see the module docstring for each figure)."""

    name: str
    num_prompt_tokens: int
    num_continuation_tokens: int
    max_abs_dlogprob: float
    max_abs_dlogprob_position: int | None
    first_position_beyond: int | None  # the first row whose |Δlogprob| exceeds the bound
    argmax_differs: list[int]
    mean_kl: float
    max_kl: float
    max_kl_position: int | None
    kl_estimator: str
    greedy_divergence: dict | None
    tokenization_divergence: int | None
    rows_compared: int
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["ok"] = self.ok
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def score(ref: Reference, obs: Observation, tol: Tolerance, token_text) -> PromptReport:
    """Compare ``obs`` with ``ref`` (module docstring); ``token_text(id)`` decodes one id.

    Returns:
        A :class:`PromptReport` whose ``failures`` name each bound exceeded, the prompt and the position.
    """
    seq = ref.sequence
    n_rows = len(seq)
    name = ref.prompt.name
    failures = []

    def where(row: int) -> str:
        nxt = f", before {token_text(seq[row + 1])!r}" if row + 1 < n_rows else ", after the sequence"
        return f"position {row} (after {token_text(seq[row])!r}{nxt})"

    # tokenization
    tok_div = None
    if obs.prompt_ids is not None and obs.prompt_ids != ref.prompt_ids:
        a, b = obs.prompt_ids, ref.prompt_ids
        tok_div = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
        ours = token_text(a[tok_div]) if tok_div < len(a) else "(end)"
        theirs = token_text(b[tok_div]) if tok_div < len(b) else "(end)"
        failures.append(f"{name}: the prompt's token {tok_div} differs: {ours!r} (test) vs {theirs!r} (reference)")

    # per row: |Δlogprob|, argmax, KL
    max_d, max_d_row, first_beyond = 0.0, None, None
    flips, kls = [], np.full(n_rows, np.nan)
    full = ref.logprobs is not None and obs.logprobs is not None
    for start in range(0, n_rows, ROW_BLOCK):
        rows = range(start, min(start + ROW_BLOCK, n_rows))
        if full:
            kls[start:rows.stop] = np.maximum(kl_divergence(ref.logprobs[start:rows.stop].astype(np.float64),
                                                            obs.logprobs[start:rows.stop].astype(np.float64)),
                                              0.0)  # >= 0 but for rounding
        for r in rows:
            if not obs.has_row(r):
                continue
            ids = ref.top_ids[r]
            want = ref.top_logprobs[r]
            if r + 1 < n_rows:
                ids, want = np.append(ids, seq[r + 1]), np.append(want, ref.next_logprobs[r])
            got = obs.values(r, ids)
            d = np.abs(got - want)
            row_max = float(np.nanmax(d)) if np.any(~np.isnan(d)) else 0.0
            if row_max > max_d:
                max_d, max_d_row = row_max, r
            if first_beyond is None and tol.max_abs_dlogprob is not None and row_max > tol.max_abs_dlogprob:
                first_beyond = r
            if not full:
                kls[r] = topk_rest_kl(ref.top_logprobs[r], obs.values(r, ref.top_ids[r]))
            if _top_differs(ref, obs, r, token_text):
                flips.append(r)
    compared = ~np.isnan(kls)
    mean_kl = float(kls[compared].mean()) if compared.any() else float("nan")
    max_kl_row = int(np.nanargmax(kls)) if compared.any() else None

    if tol.max_abs_dlogprob is not None and max_d > tol.max_abs_dlogprob:
        failures.append(f"{name}: |Δlogprob| > {tol.max_abs_dlogprob:g} first at {where(first_beyond)}; the largest, "
                        f"{max_d:.3g}, at {where(max_d_row)}")
    if compared.any() and mean_kl > tol.mean_kl:
        failures.append(f"{name}: mean KL {mean_kl:.3g} > {tol.mean_kl:g} nats (largest at {where(max_kl_row)}: "
                        f"{kls[max_kl_row]:.3g})")
    for r in flips:
        margin = _ref_margin(ref, r, obs.argmax(r))
        if margin > tol.flip_margin:
            failures.append(f"{name}: the most likely token differs at {where(r)}, where the reference's margin is "
                            f"{margin:.3g} > {tol.flip_margin:g}")
            break  # the first is named; all are counted in argmax_differs

    # greedy continuations
    div = greedy_divergence(ref, obs, token_text)
    if div is not None:
        margin = _ref_margin(ref, div["row"], div.get("test_id"))
        div["reference_margin"] = margin
        if margin > tol.flip_margin:
            failures.append(f"{name}: the greedy continuation diverges at generated token {div['index']}: "
                            f"{div['test']!r} (test) vs {div['reference']!r} (reference), margin {margin:.3g} > "
                            f"{tol.flip_margin:g}")
    return PromptReport(name, len(ref.prompt_ids), len(ref.continuation_ids), max_d, max_d_row, first_beyond, flips,
                        mean_kl,
                        float(np.nanmax(kls)) if compared.any() else float("nan"), max_kl_row,
                        "full" if full else f"top-{ref.top_ids.shape[1]}+rest", div, tok_div, int(compared.sum()),
                        failures)


def topk_rest_kl(ref_top: np.ndarray, test_vals: np.ndarray) -> float:
    """KL over ``k + 1`` buckets: the reference's top-k tokens the test side reports (nan:
    not reported, folded into the rest) and one bucket of the remaining mass, nats."""
    known = ~np.isnan(test_vals)
    p, q = np.exp(ref_top[known]), np.exp(test_vals[known])
    p_rest, q_rest = max(1.0 - p.sum(), 0.0), max(1.0 - q.sum(), 1e-12)
    kl = float(np.sum(p * (ref_top[known] - test_vals[known])))
    if p_rest > 0:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0)


def _top_differs(ref: Reference, obs: Observation, r: int, token_text) -> bool:
    top = obs.argmax(r)
    if top is not None:
        return top != int(ref.top_ids[r, 0])
    if obs.top_texts is not None and r < len(obs.top_texts) and obs.top_texts[r] is not None:
        return obs.top_texts[r] != token_text(int(ref.top_ids[r, 0]))
    return False


def _ref_margin(ref: Reference, r: int, other: int | None) -> float:
    """The reference's ``logprob(top) - logprob(other)`` at row ``r``; for a token outside its
    top-k, the gap to its k-th (a lower bound); inf for an unknown token."""
    best = float(ref.top_logprobs[r, 0])
    if other is None:
        return math.inf
    if ref.logprobs is not None:
        return best - float(ref.logprobs[r, other])
    hit = np.nonzero(ref.top_ids[r] == other)[0]
    return best - float(ref.top_logprobs[r, hit[0] if len(hit) else -1])


def greedy_divergence(ref: Reference, obs: Observation, token_text) -> dict | None:
    """The first generated token where ``obs``'s greedy continuation differs from the
    reference's: ``{"index", "row", "reference", "test", "test_id"}`` (texts decoded), or None."""
    want = ref.continuation_ids
    if obs.continuation_ids is not None:
        got_ids = obs.continuation_ids
        got = [token_text(t) for t in got_ids]
    elif obs.continuation_texts is not None:
        got_ids, got = None, obs.continuation_texts
    else:
        return None
    for i, t in enumerate(want):
        if i >= len(got):
            return {"index": i, "row": len(ref.prompt_ids) + i - 1, "reference": token_text(t), "test": "(end)",
                    "test_id": None}
        same = got_ids[i] == t if got_ids is not None else got[i] == token_text(t)
        if not same:
            return {"index": i, "row": len(ref.prompt_ids) + i - 1, "reference": token_text(t), "test": got[i],
                    "test_id": None if got_ids is None else int(got_ids[i])}
    return None


# --- transformers: the reference ----------------------------------------------------------------

class TransformersReference:
    """transformers' float32 model with eager attention, and its tokenizer, for one model
    (a directory, or a GGUF file that transformers dequantizes to float32).

    Raises:
        ImportError: torch or transformers is not installed.
    """

    def __init__(self, model_path: Path, lora_path: str | os.PathLike | None = None):
        import torch
        import transformers

        from refengine.formats.gguf_file import is_gguf

        self.torch = torch
        transformers.utils.logging.disable_progress_bar()
        where, kwargs = (model_path.parent, {"gguf_file": model_path.name}) if is_gguf(model_path) else (model_path, {})
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            where, dtype=torch.float32, attn_implementation="eager", **kwargs).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(where, **kwargs)
        self.versions = {"transformers": transformers.__version__, "torch": torch.__version__}
        if lora_path is not None:  # the adapter on top, unmerged, as peft runs it
            import peft

            self.model = peft.PeftModel.from_pretrained(self.model, str(lora_path)).eval()
            self.versions["peft"] = peft.__version__

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def has_chat_template(self) -> bool:
        return getattr(self.tokenizer, "chat_template", None) is not None

    def prompt_ids(self, prompt: PromptSpec) -> list[int]:
        if prompt.messages is None:
            return self.encode(prompt.text)
        text = self.tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False)

    def reference(self, prompt: PromptSpec, max_tokens: int, top_k: int) -> Reference:
        """The prompt's ids, ``max_tokens`` greedy tokens (``generate``, EOS ignored), and
        the log-probabilities of one forward over both."""
        import copy

        torch = self.torch
        ids = self.prompt_ids(prompt)
        with torch.inference_mode():
            cont = []
            if max_tokens:
                cfg = copy.deepcopy(self.model.generation_config)
                cfg.eos_token_id = None  # a pure greedy run of max_tokens, as ignore_eos
                # no min_new_tokens: its processor would mask EOS, which a pure greedy run may pick
                cfg.update(do_sample=False, temperature=None, top_p=None, top_k=None, max_new_tokens=max_tokens,
                           pad_token_id=0)
                out = self.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                          generation_config=cfg)
                cont = out[0, len(ids):].tolist()
            logits = self.model(torch.tensor([ids + cont])).logits[0].float().numpy()
        return Reference.from_logprobs(prompt, ids, cont, logprob_rows(logits), top_k)


# --- refengine: the side under test ------------------------------------------------------------

def refengine_prompt_ids(engine, prompt: PromptSpec) -> list[int] | None:
    """refengine's own tokenization of ``prompt`` (None without a tokenizer, or a chat
    prompt without a chat template)."""
    tok = engine.tokenizer
    if tok is None:
        return None
    if prompt.messages is None:
        return tok.encode(prompt.text, add_special_tokens=True)
    if tok.chat_template is None:
        return None
    return tok.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True)


def refengine_observation(engine, ref: Reference, lora_request=None) -> Observation:
    """refengine on ``ref``'s sequence: full log-probability rows from the engine's prefill
    (:meth:`LLMEngine.prompt_logits`) and its own greedy continuation of the prompt ids
    (prefill then decode steps, EOS ignored), under ``lora_request``'s adapter (None: none)."""
    from refengine.sampling_params import SamplingParams

    logprobs = logprob_rows(engine.prompt_logits(ref.sequence, lora_request=lora_request))
    cont = None
    if ref.continuation_ids:
        rid = "__compare__"
        engine.add_request(rid, list(ref.prompt_ids), SamplingParams(max_tokens=len(ref.continuation_ids),
                                                                     temperature=0.0, ignore_eos=True),
                           lora_request=lora_request)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    cont = list(out.outputs[0].token_ids)
    return Observation(refengine_prompt_ids(engine, ref.prompt), cont, logprobs=logprobs)


# --- a server: the side under test ------------------------------------------------------------

def _request(url: str, body: dict | None, api_key: str | None, timeout: float) -> dict:
    """GET (``body`` None) or POST JSON to ``url``; the JSON answer.

    Raises:
        ValueError: unreachable, or an HTTP error status (its body quoted).
    """
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise ValueError(f"{url} answered HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
        raise ValueError(f"could not read {url}: {getattr(e, 'reason', e)}") from None


def served_model_name(url: str, api_key: str | None, timeout: float = 60.0) -> str:
    """The first model ``GET {url}/models`` lists."""
    data = _request(url.rstrip("/") + "/models", None, api_key, timeout).get("data") or []
    if not data:
        raise ValueError(f"{url}/models lists no model: pass --served-model-name")
    return data[0]["id"]


def engine_url_observation(url: str, model: str, ref: Reference, token_texts: dict[int, str],
                           api_key: str | None = None, timeout: float = 300.0) -> Observation:
    """A server's view of ``ref``'s sequence (module docstring: what is sent and how
    entries are matched to ids).

    Args:
        url: the API root, ``http://host:port/v1``.
        token_texts: id -> decoded text of every id the reference mentions.
    Raises:
        ValueError: the server cannot be reached, refuses a request, or answers without logprobs.
    """
    base = url.rstrip("/") + "/completions"
    k = ref.top_ids.shape[1]
    by_text: dict[str, list[int]] = {}
    for t, text in token_texts.items():
        by_text.setdefault(text, []).append(int(t))

    def resolve(key: str) -> int | None:
        if key.startswith("token_id:") and key[9:].lstrip("-").isdigit():
            return int(key[9:])
        ids = by_text.get(key, [])
        return ids[0] if len(ids) == 1 else None

    seq = ref.sequence
    body = {"model": model, "prompt": seq, "echo": True, "max_tokens": 1, "logprobs": k, "temperature": 0.0}
    choice = _request(base, body, api_key, timeout)["choices"][0]
    lp = choice.get("logprobs")
    if not lp or not lp.get("top_logprobs"):
        raise ValueError(f"{base} answered without logprobs for an echo request (logprobs={k})")
    sparse: list[dict[int, float]] = [{} for _ in seq]
    top_ids: list[int | None] = [None] * len(seq)
    top_texts: list[str | None] = [None] * len(seq)
    tops, own = lp["top_logprobs"], lp["token_logprobs"]
    for j in range(1, min(len(tops), len(seq) + 1)):  # entry j scores token j (row j - 1); entry S: the generated one
        row = j - 1
        entry = tops[j] or {}
        for key, value in entry.items():
            t = resolve(key)
            if t is not None:
                sparse[row][t] = float(value)
        if j < len(seq) and own[j] is not None:
            sparse[row][seq[j]] = float(own[j])  # by position: the echoed token's own id
        shared = any(len(by_text.get(key, ())) > 1 for key in entry)  # one value stands for several ids
        if entry and not shared:
            best = max(entry, key=entry.get)
            if resolve(best) is None:
                top_texts[row] = best
            else:
                top_ids[row] = resolve(best)
    # the greedy continuation of the prompt alone
    cont_ids = cont_texts = None
    if ref.continuation_ids:
        body = {"model": model, "prompt": ref.prompt_ids, "max_tokens": len(ref.continuation_ids), "temperature": 0.0,
                "logprobs": 1, "ignore_eos": True, "return_token_ids": True}
        choice = _request(base, body, api_key, timeout)["choices"][0]
        if choice.get("token_ids") is not None:
            cont_ids = [int(t) for t in choice["token_ids"]]
        elif choice.get("logprobs"):
            cont_texts = list(choice["logprobs"]["tokens"])
    return Observation(None, cont_ids, sparse=sparse, top_ids=top_ids, top_texts=top_texts,
                       continuation_texts=cont_texts)


# --- golden files -----------------------------------------------------------------------------

def model_files_sha256(model_path: Path) -> dict[str, str]:
    """sha256 (hex) of the weights: the GGUF file, or each ``*.safetensors`` of a directory,
    by file name."""
    files = [model_path] if model_path.is_file() else sorted(model_path.glob("*.safetensors"))
    out = {}
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
        out[f.name] = h.hexdigest()
    return out


def save_golden(path: str | os.PathLike, refs: list[Reference], token_texts: dict[int, str], *, model: str,
                model_sha256: dict[str, str], versions: dict[str, str], max_tokens: int, top_k: int,
                lora: dict | None = None) -> None:
    """Write the golden file (docs/compare.md: the format); log-probabilities are rounded to 1e-6.
    ``lora``: the adapter the reference ran (``{"path", "sha256"}``), None for none."""
    def r6(a):
        return [round(float(x), 6) for x in a]

    mentioned = set()
    for ref in refs:
        mentioned.update(ref.sequence)
        mentioned.update(int(t) for t in ref.top_ids.reshape(-1))
    doc = {
        "format": GOLDEN_FORMAT, "version": GOLDEN_VERSION, "model": model, "model_sha256": model_sha256,
        "versions": versions, "reference": "transformers, float32, eager attention", "max_tokens": max_tokens,
        "top_k": top_k, "lora": lora, "token_texts": {str(t): token_texts[t] for t in sorted(mentioned)},
        "prompts": [{**ref.prompt.to_dict(), "prompt_token_ids": ref.prompt_ids,
                     "continuation_token_ids": ref.continuation_ids, "next_logprobs": r6(ref.next_logprobs),
                     "top_token_ids": ref.top_ids.tolist(), "top_logprobs": [r6(row) for row in ref.top_logprobs]}
                    for ref in refs],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")


def load_golden(path: str | os.PathLike) -> tuple[dict, list[Reference], dict[int, str]]:
    """(the file's header fields, its references, id -> decoded text).

    Raises:
        ValueError: not a golden file of a version this refengine reads, or inconsistent shapes.
    """
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read golden file {path}: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != GOLDEN_FORMAT:
        raise ValueError(f"{path} is not a refengine golden file (no \"format\": \"{GOLDEN_FORMAT}\")")
    if doc.get("version") != GOLDEN_VERSION:
        raise ValueError(f"{path} has golden format version {doc.get('version')!r}; this refengine reads "
                         f"version {GOLDEN_VERSION}")
    try:
        return _golden_contents(doc, path)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: a malformed golden file ({type(e).__name__}: {e})") from None


def _golden_contents(doc: dict, path) -> tuple[dict, list[Reference], dict[int, str]]:
    refs = []
    for p in doc["prompts"]:
        spec = PromptSpec(p["name"], text=p.get("text"), messages=p.get("messages"))
        ref = Reference(spec, list(p["prompt_token_ids"]), list(p["continuation_token_ids"]),
                        np.array(p["top_token_ids"], dtype=np.int64), np.array(p["top_logprobs"], dtype=np.float64),
                        np.array(p["next_logprobs"], dtype=np.float64))
        n = len(ref.sequence)
        if ref.top_ids.shape[0] != n or ref.top_logprobs.shape != ref.top_ids.shape or len(ref.next_logprobs) != n - 1:
            raise ValueError(f"{path}: prompt {spec.name!r} has {n} tokens but rows of other lengths")
        refs.append(ref)
    header = {k: v for k, v in doc.items() if k not in ("prompts", "token_texts")}
    return header, refs, {int(t): s for t, s in doc["token_texts"].items()}


# --- the command ------------------------------------------------------------------------------

def _dtype_name(dtype) -> str:
    return "bfloat16" if "bfloat16" in str(dtype) else np.dtype(dtype).name


def _mentioned(ref: Reference) -> set[int]:
    return set(ref.sequence) | {int(t) for t in ref.top_ids.reshape(-1)}


def run_compare(prompts, *, max_tokens: int, top_k: int, save, golden, engine_url, served_model, api_key,
                engine_args, echo, lora_path=None) -> dict:
    """The body of ``refengine compare`` (:func:`compare_cmd`), returning the JSON report;
    ``echo(line)`` prints progress lines of the text report. ``lora_path``: a PEFT adapter
    both sides run (transformers through peft; refengine as a :class:`refengine.lora.LoRARequest`,
    with ``enable_lora``; a server is asked for ``served_model``, the adapter's name there).

    Raises:
        ValueError: a bad combination of options, a golden file that cannot be read (or
            made with another adapter, or none, than ``lora_path``), a prompt the engine
            refuses, or a server that cannot be queried.
        ImportError: transformers (or, with ``lora_path``, peft) is needed (no ``--golden``) and missing.
    """
    import refengine
    from refengine.lora import ADAPTER_WEIGHTS, LoRARequest

    if golden and (save or prompts):
        raise ValueError("--golden takes its prompts from the file: give no PROMPT and no --save")
    header, golden_refs, golden_texts = load_golden(golden) if golden else ({}, None, {})
    if golden:
        max_tokens, top_k = header["max_tokens"], header["top_k"]
        made_with = (header.get("lora") or {}).get("path")
        if (made_with is None) != (lora_path is None):
            raise ValueError(f"{golden} was made " + (f"with the LoRA adapter {made_with}: give --lora-path" if made_with
                                                        else "without a LoRA adapter: give no --lora-path"))
    lora_request, lora = None, None
    if lora_path is not None:
        lora_request = LoRARequest("compare", 1, str(lora_path))
        engine_args = dataclasses.replace(engine_args, enable_lora=True)
        weights = Path(lora_path) / ADAPTER_WEIGHTS
        lora = {"path": str(lora_path),
                "sha256": hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else None}

    engine = None
    if engine_url:
        model_path = None if golden else engine_args.model_config()[0]
        tol = tolerance_for("float32" if engine_args.dtype == "auto" else engine_args.dtype,
                            engine_args.quantization, engine_args.kv_cache_dtype)
        served_model = served_model or served_model_name(engine_url, api_key)
        target = {"kind": "server", "url": engine_url, "model": served_model}
    else:
        engine = engine_from_args(engine_args)
        model_path = engine.model_dir
        cfg = engine.config
        tol = tolerance_for(_dtype_name(cfg.dtype), cfg.quantization, cfg.kv_cache_dtype)
        target = {"kind": "refengine", "model": str(model_path), "lora": lora_path and str(lora_path),
                  "dtype": _dtype_name(cfg.dtype),
                  "quantization": cfg.quantization, "kv_cache_dtype": cfg.kv_cache_dtype,
                  "attention_backend": cfg.attention_backend, "device": cfg.device}

    hf = None
    notes = []
    if golden:
        source = {"kind": "golden", "path": str(golden), "model": header.get("model"),
                  "versions": header.get("versions"), "model_sha256": header.get("model_sha256")}
        if engine is not None and header.get("model_sha256"):
            now = model_files_sha256(Path(model_path))
            if now != header["model_sha256"]:
                notes.append(f"the model files' sha256 differ from the golden file's ({header['model']}): "
                             "the values below decide")
        specs = [r.prompt for r in golden_refs]
    else:
        hf = TransformersReference(Path(model_path), lora_path)
        source = {"kind": "transformers", "model": str(model_path), "lora": lora_path and str(lora_path),
                  "dtype": "float32", "attention": "eager", "versions": hf.versions}
        if prompts:
            specs = [PromptSpec(f"prompt-{i + 1}", text=p) for i, p in enumerate(prompts)]
        else:
            if engine is not None:
                sliding, limit = engine.model_config.sliding_window, engine.config.max_model_len
            else:
                mc = engine_args.model_config()[1]
                sliding, limit = mc.sliding_window, mc.max_position_embeddings
            specs = default_prompts(hf.encode, has_chat_template=hf.has_chat_template(), sliding_window=sliding,
                                    max_len=limit - max_tokens - 1)

    def token_text(t: int) -> str:
        t = int(t)
        if t in golden_texts:
            return golden_texts[t]
        if hf is not None:
            return hf.token_text(t)
        if engine is not None and engine.tokenizer is not None:
            return engine.tokenizer.decode([t], skip_special_tokens=False)
        return f"token_id:{t}"

    echo(f"reference: {_describe(source)}")
    echo(f"compared:  {_describe(target)}")
    echo(tol.describe())
    echo(f"{'prompt':<10} {'tokens':>9}  {'max |Δlogprob|':>16}  {'argmax≠':>7}  {'mean KL':>9}  greedy")
    for note in notes:
        echo(f"note: {note}")
    reports, saved, texts = [], [], {}
    for i, spec in enumerate(specs):
        ref = golden_refs[i] if golden else hf.reference(spec, max_tokens, top_k)
        if not golden:
            texts.update({t: token_text(t) for t in _mentioned(ref)})
        if engine is not None:
            obs = refengine_observation(engine, ref, lora_request)
        else:
            obs = engine_url_observation(engine_url, served_model, ref,
                                         {t: token_text(t) for t in _mentioned(ref)}, api_key)
        rep = score(ref, obs, tol, token_text)
        ref.logprobs = None  # full rows are not kept past their prompt
        reports.append(rep)
        saved.append(ref)
        echo(_report_line(rep))
    failures = [f for r in reports for f in r.failures]
    if save is not None:
        versions = {"refengine": refengine.__version__, "numpy": np.__version__, **hf.versions}
        save_golden(save, saved, texts, model=str(model_path), model_sha256=model_files_sha256(Path(model_path)),
                    versions=versions, max_tokens=max_tokens, top_k=top_k, lora=lora)
    return {"reference": source, "compared": target, "tolerance": dataclasses.asdict(tol), "top_k": top_k,
            "max_tokens": max_tokens, "notes": notes, "prompts": [r.to_dict() for r in reports],
            "failures": failures, "ok": not failures, "saved": None if save is None else str(save)}


def _describe(d: dict) -> str:
    main = d.get("url") or d.get("path") or d.get("model")
    rest = ", ".join(f"{k} {v}" for k, v in d.items() if k not in ("kind", "url", "path", "model", "versions",
                                                                     "model_sha256") and v is not None)
    versions = d.get("versions") or {}
    vs = ", ".join(f"{k} {v}" for k, v in versions.items() if k in ("transformers", "torch"))
    return f"{d['kind']} {main}" + (f" ({rest})" if rest else "") + (f" [{vs}]" if vs else "")


def _report_line(r: PromptReport) -> str:
    d = f"{r.max_abs_dlogprob:.2e} @ {r.max_abs_dlogprob_position}" if r.rows_compared else "n/a"
    kl = f"{r.mean_kl:.2e}" if not math.isnan(r.mean_kl) else "n/a"
    g = r.greedy_divergence
    greedy = (f"same ({r.num_continuation_tokens} tokens)" if g is None else
              f"diverges at token {g['index']}: {g['test']!r} vs reference {g['reference']!r}")
    return (f"{r.name:<10} {r.num_prompt_tokens:>5}+{r.num_continuation_tokens:<3}  {d:>16}  "
            f"{len(r.argmax_differs):>7}  {kl:>9}  {greedy}  {'ok' if r.ok else 'FAIL'}")


@click.command("compare")
@click.argument("prompts", nargs=-1, type=TEXT)
@click.option("--max-tokens", type=click.IntRange(min=0), default=DEFAULT_MAX_TOKENS, show_default=True,
              help="greedy tokens generated after each prompt (and scored)")
@click.option("--top-k", type=click.IntRange(min=1), default=DEFAULT_TOP_K, show_default=True,
              help="most likely tokens per position kept in a golden file and compared")
@click.option("--save", type=click.Path(dir_okay=False), default=None, show_default="none",
              help="write transformers' reference to this golden file (JSON)")
@click.option("--golden", type=click.Path(exists=True, dir_okay=False), default=None, show_default="none",
              help="compare against this golden file instead of running transformers (which it does not need)")
@click.option("--engine-url", default=None, show_default="none",
              help="compare an OpenAI-compatible server (http://host:port/v1) instead of refengine in this "
                   "process; --dtype/--quantization/--kv-cache-dtype then say what it runs (the tolerances)")
@click.option("--served-model-name", default=None, show_default="the first of GET /v1/models",
              help="the model name sent to --engine-url")
@click.option("--api-key", default=None, envvar="OPENAI_API_KEY", show_default="$OPENAI_API_KEY",
              help="bearer token for --engine-url")
@click.option("--lora-path", type=click.Path(exists=True, file_okay=False), default=None, show_default="none",
              help="a PEFT LoRA adapter directory run on both sides (transformers + peft; refengine with "
                   "--enable-lora); with --engine-url, name the server's adapter with --served-model-name")
@click.option("--json", "as_json", is_flag=True, show_default="off", help="print one JSON report instead of text")
@engine_options
def compare_cmd(prompts, max_tokens, top_k, save, golden, engine_url, served_model_name, api_key, lora_path,
                as_json, **kw):
    """Compare refengine's log-probabilities and greedy continuations with transformers'
    (float32, eager), or with a golden file; exit status 1 beyond the printed tolerances.

    PROMPTS default to a built-in set: chat, code, digits, CJK, emoji and one longer
    than the model's sliding window. See docs/compare.md.
    """
    try:
        args = EngineArgs.from_cli(kw)
    except ValueError as e:
        fail(str(e))
    lines = []
    echo = lines.append if as_json else click.echo
    try:
        report = run_compare(prompts, max_tokens=max_tokens, top_k=top_k, save=save, golden=golden,
                             engine_url=engine_url, served_model=served_model_name, api_key=api_key,
                             engine_args=args, echo=echo, lora_path=lora_path)
    except ImportError as e:
        fail(f"refengine compare without --golden runs transformers, which cannot be imported ({e}): "
             "pip install 'refengine[compare]', or check against a golden file with --golden FILE", exit_code=1)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    if as_json:
        click.echo(json.dumps(report))
    else:
        for f in report["failures"]:
            click.echo(f"FAIL {f}")
        if report["saved"]:
            click.echo(f"wrote {report['saved']}")
        click.echo("all within the tolerances" if report["ok"] else
                   f"{len(report['failures'])} failure(s) beyond the tolerances")
    return 0 if report["ok"] else 1
