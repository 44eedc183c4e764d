"""One request's state as it moves through the engine, and what the engine returns for it."""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field

from refengine.sampler import TokenUniforms
from refengine.sampling_params import SamplingParams


@dataclass
class Logprob:
    """One token's log-probability in one position's distribution (vLLM's ``Logprob``).

    Attributes:
        logprob: natural-log probability, float (``-inf`` for a token the model rules out).
        rank: 1-based rank in that distribution (1: the most likely; tokens with a larger
            log-probability, plus one).
        decoded_token: the token's text on its own (``tokenizer.decode([id])``, special
            tokens kept); None without a tokenizer.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One prompt position's entry of ``prompt_logprobs``: {token id: Logprob}, the actual prompt
# token first, then the top k (None for position 0, which nothing predicts).
PromptLogprobs = list["dict[int, Logprob] | None"]


class SequenceStatus(enum.Enum):
    """WAITING (queued or preempted), RUNNING (has KV blocks), FINISHED."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A prompt and the tokens generated after it.

    ``num_computed_tokens`` counts the tokens whose K/V are in the cache. At admission it
    is set to the length of the cached prefix the sequence reuses (0 without a prefix
    cache hit; :meth:`refengine.core.block_manager.BlockManager.allocate`); after that only
    :meth:`refengine.core.scheduler.Scheduler.postprocess` advances it, once a step's chunk has
    run. A sequence whose prompt is fully computed and which is not finished is decoding.
    ``block_table`` lists the physical KV blocks that hold positions
    ``0 .. len(block_table) * block_size - 1``. ``detokenizer`` turns its output ids into
    text (None for a model without a tokenizer). ``uniforms`` gives its random numbers,
    keyed by ``(seed, index, output position)`` (:class:`refengine.sampler.TokenUniforms`).

    Prefix caching: ``block_hashes`` is the hash chain of the full blocks of its tokens
    (prompt, then output), computed as needed and kept across preemption (the tokens do not
    change); ``cache_salt`` (a string) enters the first block's hash, so only sequences
    with the same salt share blocks, and so does ``lora_request`` (the LoRA adapter the
    sequence runs with, :mod:`refengine.lora`; None for the base model), so blocks computed
    under one adapter serve only that adapter; ``num_cached_tokens`` is how many prompt tokens came
    from the cache at its first admission (None until then).
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, index: int = 0, detokenizer=None,
                 cache_salt: str | None = None, prompt_logprobs: PromptLogprobs | None = None,
                 lora_request=None):
        self.request_id = request_id
        self.index = index  # which of the n completions of the request
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []  # per output token, when asked
        # SamplingParams.prompt_logprobs: entry j is position j's {token_id: Logprob} (entry 0
        # None); one list shared by the request's n sequences, filled once whichever computes
        # a position first (refengine.core.model_runner.prompt_logprob_rows). None: not asked.
        if prompt_logprobs is None and sampling_params.prompt_logprobs is not None:
            prompt_logprobs = [None]
        self.prompt_logprobs = prompt_logprobs
        self.num_reported_tokens = 0  # output tokens already sent in a RequestOutput (for delta_token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # a refengine.lora.LoRARequest, None for the base model
        self.num_cached_tokens: int | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.detokenizer = detokenizer
        # Random draws keyed by (seed, index, output position), so a seed gives the same tokens
        # whatever the batch, the speculation or a recompute; an unseeded request draws a
        # seed once here, so both take one code path.
        seed = sampling_params.seed if sampling_params.seed is not None else secrets.randbits(64)
        self.uniforms = TokenUniforms(seed, index)

    # --- sizes -------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """``(prompt_token_ids + output_token_ids)[start:end]`` without building the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before this sequence can sample."""
        return len(self) - self.num_computed_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt log-probabilities were asked for and some positions still lack
        them (such a sequence takes no prefix-cache hits: its rows must be computed)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def checkpoint(self) -> tuple:
        """The state a step's results change (outputs, logprobs, the detokenizer's text), for
        :meth:`rollback`. O(1): lists only grow within a step, so their lengths suffice."""
        detok = self.detokenizer.checkpoint() if self.detokenizer is not None else None
        return len(self.output_token_ids), len(self.logprobs), detok

    def rollback(self, checkpoint: tuple) -> None:
        """Undo everything appended since :meth:`checkpoint` returned ``checkpoint``."""
        num_outputs, num_logprobs, detok = checkpoint
        del self.output_token_ids[num_outputs:]
        del self.logprobs[num_logprobs:]
        if detok is not None:
            self.detokenizer.rollback(detok)

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop the blocks; prompt, outputs and block hashes are kept."""
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table = []


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's ``CompletionOutput``).

    With ``SamplingParams.output_kind`` DELTA, ``text``, ``token_ids`` and ``logprobs``
    hold only what is new since the request's previous output (the deltas concatenate to
    the completion); otherwise (CUMULATIVE, FINAL_ONLY) everything so far.

    Attributes:
        index: which of the ``n`` completions.
        text: decoded text so far (stop string cut unless included).
        token_ids: generated token ids (EOS / stop id included, as vLLM does).
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` (the request's masks left
            no token to sample: :data:`refengine.sampler.NO_TOKEN`) or None while running.
        stop_reason: the stop string or token id that matched (None for EOS or length).
        logprobs: per generated token, ``{token_id: logprob}`` for the sampled token and
            the top ``SamplingParams.logprobs`` tokens; None unless asked.
        delta_text: text added since the previous output of this request (streaming).
        delta_token_ids: token ids added since the previous output of this request.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What the engine reports for one request (vLLM's ``RequestOutput``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: object | None = None
    num_cached_tokens: int | None = None  # prompt tokens taken from the prefix cache at admission
    # SamplingParams.prompt_logprobs: one entry per prompt token (the first None), each
    # {token_id: Logprob} of the prompt token and the top k; sent once, in the request's first
    # output after its prompt is computed (the final one for FINAL_ONLY), else None.
    prompt_logprobs: PromptLogprobs | None = None
