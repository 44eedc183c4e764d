"""``AsyncEngine``: the one owner of an ``LLMEngine`` inside an asyncio server.

One asyncio task runs the loop::

    apply queued ops (add_request / abort)   <- handlers queue them, any time
    engine.step() in a worker thread         <- the event loop keeps serving meanwhile
    route each RequestOutput to its request's own asyncio.Queue

Only this task touches the engine (``step`` runs in its single worker thread, adds and
aborts run between steps on the event loop), so the engine needs no locks; handlers call
only its read-only checks (``prompt_token_ids``, ``check_sampling_params``). A handler
queues an abort when its client goes away; it is applied before the next step, so the
request's KV blocks are free after at most the step that was running.

What one request must not do to the others:

- A slow reader costs O(its unread tokens), not O(steps x output length): the server asks
  for DELTA outputs (``SamplingParams.output_kind``) and a stream merges the outputs its
  reader has not taken yet into one (:class:`RequestStream`), so its backlog is one
  output per prompt, at most ``max_model_len`` tokens per sequence.
- Adds run on the event loop, between steps, and ``LLMEngine.add_request`` checks the
  request again: for params the server has checked (in a worker thread) that is O(1) per
  field, as the sampler keeps what its check built on the params (bad-word tokens, the
  allowed_token_ids mask, the grammar's matcher), so nothing is tokenized or compiled here.
- The loop is supervised: an unexpected error while adding or aborting a request fails
  only that request (:class:`EngineStepError`); a failed step fails the requests in it;
  ``max_consecutive_step_failures`` failed steps in a row, or an error escaping the loop,
  end it loudly (logged at CRITICAL, every waiting handler gets :class:`EngineDeadError`,
  ``is_running`` turns False so ``/health`` answers 503).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from refengine.core.sequence import RequestOutput
from refengine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("refengine.server")


class Overloaded(RuntimeError):
    """The engine's waiting queue is at its bound; the client should retry later."""


class EngineStepError(RuntimeError):
    """The engine failed on a request's behalf (a step, an add or an abort raised; not the
    request's fault); the request was aborted. The message holds no internal detail (the
    traceback is logged)."""


class EngineDeadError(EngineStepError):
    """The engine loop has stopped (shut down, or died of an error); nothing more runs."""


class MergedOutput:
    """The outputs of one engine request that its reader has not taken yet, as one.

    DELTA outputs concatenate (text parts joined when taken, token ids and logprobs
    extended); for the other kinds the newest output already holds everything and only
    its ``delta_text`` / ``delta_token_ids`` concatenate. :meth:`add` costs O(the new
    output), :meth:`take` O(what is pending).
    """

    def __init__(self, out: RequestOutput, delta: bool):
        self.delta = delta
        self.latest = out
        self.count = 1
        self.prompt_logprobs = out.prompt_logprobs  # sent in one output only: kept from it
        self.parts: dict[int, dict] = {}
        for c in out.outputs:
            self._add_completion(c)

    def _add_completion(self, c) -> None:
        acc = self.parts.get(c.index)
        if acc is None:
            self.parts[c.index] = {
                "text": [c.text] if self.delta else None, "delta_text": [c.delta_text],
                "token_ids": list(c.token_ids) if self.delta else None, "delta_token_ids": list(c.delta_token_ids),
                "logprobs": None if c.logprobs is None or not self.delta else list(c.logprobs)}
            return
        if self.delta:
            acc["text"].append(c.text)
            acc["token_ids"].extend(c.token_ids)
            if c.logprobs is not None:
                if acc["logprobs"] is None:
                    acc["logprobs"] = []
                acc["logprobs"].extend(c.logprobs)
        acc["delta_text"].append(c.delta_text)
        acc["delta_token_ids"].extend(c.delta_token_ids)

    def add(self, out: RequestOutput) -> None:
        self.latest = out
        self.count += 1
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        for c in out.outputs:
            self._add_completion(c)

    def take(self) -> RequestOutput:
        if self.count == 1:
            return self.latest
        outputs = []
        for c in self.latest.outputs:
            acc = self.parts[c.index]
            fields = {"delta_text": "".join(acc["delta_text"]), "delta_token_ids": acc["delta_token_ids"]}
            if self.delta:
                fields.update(text="".join(acc["text"]), token_ids=acc["token_ids"], logprobs=acc["logprobs"])
            outputs.append(dataclasses.replace(c, **fields))
        return dataclasses.replace(self.latest, outputs=outputs, prompt_logprobs=self.prompt_logprobs)


class RequestStream:
    """The engine requests of one HTTP request (one per prompt) and their outputs.

    ``async for tag, output in stream`` yields ``(prompt index, RequestOutput)`` until
    every prompt's request has finished. Outputs of one prompt that arrive while the reader
    is busy are merged (:class:`MergedOutput`), so what waits is at most one output per prompt;
    prompts take turns. :meth:`close` aborts those that have not finished; call it in a
    ``finally`` so that a client that goes away frees its KV blocks.

    Raises (while iterating, after the outputs that came before it):
        EngineStepError: the engine failed on this request; it is already aborted.
        EngineDeadError: the engine loop stopped.
    """

    def __init__(self, owner: AsyncEngine, request_ids: list[str], delta: bool = True):
        self.owner = owner
        self.request_ids = request_ids
        self.delta = delta
        self._pending: dict[int, MergedOutput] = {}  # tag -> merged outputs; oldest first
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._open = set(range(len(request_ids)))

    @property
    def num_pending(self) -> int:
        """Prompts with outputs waiting to be read (at most one merged output each)."""
        return len(self._pending)

    def put(self, tag: int, out: RequestOutput) -> None:
        """Hand the reader one output (the loop calls this; merged with any not yet read)."""
        merged = self._pending.get(tag)
        if merged is None:
            self._pending[tag] = MergedOutput(out, self.delta)
        else:
            merged.add(out)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (raised after the outputs already pending)."""
        if self._error is None:
            self._error = error
        self._ready.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._open:
            raise StopAsyncIteration
        while not self._pending and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if self._pending:
            tag = next(iter(self._pending))
            out = self._pending.pop(tag).take()
            if out.finished:
                self._open.discard(tag)
            return tag, out
        self._open.clear()
        raise self._error

    def close(self) -> None:
        """Abort every request of this stream that has not finished (idempotent)."""
        for tag in sorted(self._open):
            self.owner.abort(self.request_ids[tag])
        self._open.clear()
        self._pending.clear()


class AsyncEngine:
    """Serves one ``LLMEngine`` to many asyncio handlers.

    Args:
        engine: the engine; nothing else may call it while this runs.
        max_waiting_requests: refuse new work (:class:`Overloaded`) while this many
            sequences wait for a first schedule (engine queue plus adds not yet applied).
        max_consecutive_step_failures: this many failed steps in a row end the loop
            (:class:`EngineDeadError`, ``is_running`` False): an engine that fails every
            step is broken, and a health check must say so.

    Attributes:
        num_steps: engine steps run so far.
        dead: the error that ended the loop, or None.
    """

    def __init__(self, engine, *, max_waiting_requests: int = 1024, max_consecutive_step_failures: int = 3):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.max_consecutive_step_failures = max_consecutive_step_failures
        self.num_steps = 0
        self.dead: BaseException | None = None
        self._failed_steps = 0  # in a row
        self._ops: collections.deque = collections.deque()
        self._pending_seqs = 0  # sequences in queued adds
        self._streams: dict[str, tuple[RequestStream, int]] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        # One thread, always the same one: step() never runs twice at once, and a GPU
        # backend keeps one current device/stream.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="refengine-step")

    # --- life cycle (on the server's event loop) ------------------------------------------
    def start(self) -> None:
        """Start the loop task; call from inside the running event loop."""
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._supervised(), name="refengine-engine-loop")

    async def stop(self) -> None:
        """Stop the loop, abort what is left and let the running step finish."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        await asyncio.to_thread(self._executor.shutdown, wait=True)
        self._fail_everything(EngineDeadError("the server is shutting down"))

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    # --- what handlers call -------------------------------------------------------------
    def num_waiting(self) -> int:
        """Sequences waiting: the engine's queue (read between or during steps, so
        approximate by one step) plus those in adds not yet applied."""
        return len(self.engine.scheduler.waiting) + self._pending_seqs

    async def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                     cache_salt: str | None = None, lora_request=None) -> RequestStream:
        """Queue one engine request per prompt (``n`` sequences each); all or none are added.

        Args:
            request_id: the id for one prompt; ``f"{request_id}-{i}"`` for several.
            prompts: token ids, one list per prompt.
            params: the sampling parameters of every prompt (DELTA ``output_kind`` for
                O(new tokens) per step; the stream merges what its reader has not taken).
            cache_salt, lora_request: see ``LLMEngine.add_request``.
        Returns:
            The stream of their outputs.
        Raises:
            Overloaded: the waiting queue is at ``max_waiting_requests``.
            ValueError: the engine refused a prompt (nothing is left queued).
            EngineStepError: adding failed inside the engine (logged; nothing is left queued).
            EngineDeadError: the loop is not running.
        """
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        new_seqs = len(prompts) * params.n
        if self.num_waiting() + new_seqs > self.max_waiting_requests:
            raise Overloaded(f"the server is overloaded: {self.num_waiting()} sequences are waiting "
                             f"(limit {self.max_waiting_requests}); retry later")
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        stream = RequestStream(self, ids, delta=params.output_kind is RequestOutputKind.DELTA)
        added = asyncio.get_running_loop().create_future()
        # stamped now, so the engine's TTFT and queue time include the wait for the running step
        arrival = time.monotonic()
        self._ops.append(("add", stream, prompts, params, arrival, cache_salt, lora_request, added))
        self._pending_seqs += new_seqs
        self._wakeup.set()
        await added  # a handler cancelled here cancels the future: the add is then skipped
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request before the next step (unknown or finished ids are ignored)."""
        self._ops.append(("abort", request_id))
        if self._wakeup is not None:
            self._wakeup.set()

    # --- the loop -----------------------------------------------------------------------
    async def _supervised(self) -> None:
        """:meth:`_run`, and if anything escapes it: fail every request, loudly."""
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.dead = e
            logger.critical("the engine loop died; failing %d requests; /health now answers 503",
                            len(self._streams), exc_info=e)
            self._fail_everything(EngineDeadError("the engine stopped after an internal error"))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._ops:
                self._apply_ops()
            if not self.engine.has_unfinished_requests():
                self._wakeup.clear()
                if not self._ops:
                    await self._wakeup.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as e:  # the engine's fault, not a request's: fail those in flight
                self._failed_steps += 1
                logger.exception("engine step failed (%d in a row); aborting %d requests", self._failed_steps,
                                 len(self._streams))
                self._fail_all(EngineStepError("the engine failed a step"))
                if self._failed_steps >= self.max_consecutive_step_failures:
                    raise RuntimeError(f"{self._failed_steps} engine steps failed in a row") from e
                continue
            self._failed_steps = 0
            self.num_steps += 1
            for out in outputs:
                entry = self._streams.get(out.request_id)
                if entry is None:
                    continue  # aborted while the step ran
                stream, tag = entry
                stream.put(tag, out)
                if out.finished:
                    del self._streams[out.request_id]

    def _apply_ops(self) -> None:
        while self._ops:
            op = self._ops.popleft()
            if op[0] == "abort":
                self._apply_abort(op[1])
            else:
                self._apply_add(*op[1:])
        self._refresh_gauges()

    def _apply_abort(self, request_id: str) -> None:
        entry = self._streams.pop(request_id, None)
        try:
            self.engine.abort(request_id)
        except Exception:  # a bug; the request is gone from the server either way
            logger.exception("aborting request %s failed", request_id)
            if entry is not None:
                entry[0].fail(EngineStepError("the engine failed to abort the request"))

    def _apply_add(self, stream: RequestStream, prompts, params, arrival, cache_salt, lora_request, added) -> None:
        engine = self.engine
        self._pending_seqs -= len(prompts) * params.n
        if added.cancelled():
            return
        done = []
        try:
            for rid, token_ids in zip(stream.request_ids, prompts):
                engine.add_request(rid, token_ids, params, arrival_time=arrival, cache_salt=cache_salt,
                                   lora_request=lora_request)
                done.append(rid)
        except Exception as e:
            for rid in done:
                try:
                    engine.abort(rid)
                except Exception:
                    logger.exception("aborting request %s after a failed add failed", rid)
            if isinstance(e, ValueError):  # the request's fault: a 400
                added.set_exception(e)
            else:
                logger.exception("adding request %s failed", stream.request_ids[0])
                added.set_exception(EngineStepError("the engine failed to add the request"))
            return
        for tag, rid in enumerate(stream.request_ids):
            self._streams[rid] = (stream, tag)
        added.set_result(None)

    def _refresh_gauges(self) -> None:
        # The engine sets its gauges once per step; after aborts with no step to follow,
        # /metrics would keep showing the freed blocks as used.
        try:
            m, sched = self.engine.metrics, self.engine.scheduler
            m.kv_cache_usage.set(self.engine.block_manager.usage)
            m.num_requests_running.set(len(sched.running))
            m.num_requests_waiting.set(len(sched.waiting))
        except Exception:
            logger.exception("refreshing the engine's gauges failed")

    def _fail_all(self, error: Exception) -> None:
        """Abort every request in flight and end its stream with ``error``."""
        for rid, (stream, _) in list(self._streams.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                logger.exception("aborting request %s failed", rid)
            stream.fail(error)
        self._streams.clear()
        self._refresh_gauges()

    def _fail_everything(self, error: Exception) -> None:
        """:meth:`_fail_all`, and adds not yet applied get ``error`` too."""
        while self._ops:
            op = self._ops.popleft()
            if op[0] == "add":
                self._pending_seqs -= len(op[2]) * op[3].n
                if not op[-1].done():
                    op[-1].set_exception(error)
        self._fail_all(error)
