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
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from refengine.sampling_params import SamplingParams
from refengine.sequence import RequestOutput

logger = logging.getLogger("refengine.server")


class Overloaded(RuntimeError):
    """The engine's waiting queue is at its bound; the client should retry later."""


class EngineStepError(RuntimeError):
    """A step failed inside the engine (not the request's fault); its requests were aborted."""


class RequestStream:
    """The engine requests of one HTTP request (one per prompt) and their outputs.

    ``async for tag, output in stream`` yields ``(prompt index, RequestOutput)`` until
    every prompt's request has finished. :meth:`close` aborts those that have not; call
    it in a ``finally`` so that a client that goes away frees its KV blocks.

    Raises (while iterating):
        EngineStepError: the engine failed a step; the requests are already aborted.
    """

    def __init__(self, owner: AsyncEngine, request_ids: list[str]):
        self.owner = owner
        self.request_ids = request_ids
        self.queue: asyncio.Queue = asyncio.Queue()
        self._open = set(range(len(request_ids)))

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._open:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self._open.clear()
            raise item
        tag, out = item
        if out.finished:
            self._open.discard(tag)
        return tag, out

    def close(self) -> None:
        """Abort every request of this stream that has not finished (idempotent)."""
        for tag in sorted(self._open):
            self.owner.abort(self.request_ids[tag])
        self._open.clear()


class AsyncEngine:
    """Serves one ``LLMEngine`` to many asyncio handlers.

    Args:
        engine: the engine; nothing else may call it while this runs.
        max_waiting_requests: refuse new work (:class:`Overloaded`) while this many
            sequences wait for a first schedule (engine queue plus adds not yet applied).

    Attributes:
        num_steps: engine steps run so far.
    """

    def __init__(self, engine, *, max_waiting_requests: int = 1024):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.num_steps = 0
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
        self._task = asyncio.get_running_loop().create_task(self._run(), name="refengine-engine-loop")

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
        while self._ops:  # adds that never reached the engine
            op = self._ops.popleft()
            if op[0] == "add" and not op[-1].done():
                op[-1].set_exception(RuntimeError("the server is shutting down"))
        self._fail_all(EngineStepError("the server is shutting down"))

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    # --- what handlers call -------------------------------------------------------------
    def num_waiting(self) -> int:
        """Sequences waiting: the engine's queue (read between or during steps, so
        approximate by one step) plus those in adds not yet applied."""
        return len(self.engine.scheduler.waiting) + self._pending_seqs

    async def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams) -> RequestStream:
        """Queue one engine request per prompt (``n`` sequences each); all or none are added.

        Args:
            request_id: the id for one prompt; ``f"{request_id}-{i}"`` for several.
            prompts: token ids, one list per prompt.
            params: the sampling parameters of every prompt.
        Returns:
            The stream of their outputs.
        Raises:
            Overloaded: the waiting queue is at ``max_waiting_requests``.
            ValueError: the engine refused a prompt (nothing is left queued).
            RuntimeError: the loop is not running.
        """
        if not self.is_running:
            raise RuntimeError("the engine loop is not running")
        new_seqs = len(prompts) * params.n
        if self.num_waiting() + new_seqs > self.max_waiting_requests:
            raise Overloaded(f"the server is overloaded: {self.num_waiting()} sequences are waiting "
                             f"(limit {self.max_waiting_requests}); retry later")
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        stream = RequestStream(self, ids)
        added = asyncio.get_running_loop().create_future()
        # stamped now, so the engine's TTFT and queue time include the wait for the running step
        arrival = time.monotonic()
        self._ops.append(("add", stream, prompts, params, arrival, added))
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
                logger.exception("engine step failed; aborting %d requests", len(self._streams))
                self._fail_all(EngineStepError(f"the engine failed a step: {type(e).__name__}: {e}"))
                continue
            self.num_steps += 1
            for out in outputs:
                entry = self._streams.get(out.request_id)
                if entry is None:
                    continue  # aborted while the step ran
                stream, tag = entry
                stream.queue.put_nowait((tag, out))
                if out.finished:
                    del self._streams[out.request_id]

    def _apply_ops(self) -> None:
        engine = self.engine
        while self._ops:
            op = self._ops.popleft()
            if op[0] == "abort":
                engine.abort(op[1])
                self._streams.pop(op[1], None)
                continue
            _, stream, prompts, params, arrival, added = op
            self._pending_seqs -= len(prompts) * params.n
            if added.cancelled():
                continue
            done = []
            try:
                for rid, token_ids in zip(stream.request_ids, prompts):
                    engine.add_request(rid, token_ids, params, arrival_time=arrival)
                    done.append(rid)
            except ValueError as e:
                for rid in done:
                    engine.abort(rid)
                added.set_exception(e)
                continue
            for tag, rid in enumerate(stream.request_ids):
                self._streams[rid] = (stream, tag)
            added.set_result(None)
        self._refresh_gauges()

    def _refresh_gauges(self) -> None:
        # The engine sets its gauges once per step; after aborts with no step to follow,
        # /metrics would keep showing the freed blocks as used.
        m, sched = self.engine.metrics, self.engine.scheduler
        m.kv_cache_usage.set(self.engine.block_manager.usage)
        m.num_requests_running.set(len(sched.running))
        m.num_requests_waiting.set(len(sched.waiting))

    def _fail_all(self, error: Exception) -> None:
        for rid, (stream, _) in list(self._streams.items()):
            self.engine.abort(rid)
            stream.queue.put_nowait(error)
        self._streams.clear()
        self._refresh_gauges()
