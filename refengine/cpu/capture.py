"""Captured decode steps: the model's own forward, recorded once as kernel calls on fixed buffers, then replayed.

A batch-1 decode step runs a few kernels per layer, each small; around them the forward's
Python (argument checks, output allocation, kernel choice) costs a noticeable share of the
step. GPU engines remove that cost with CUDA graphs: vLLM v1 runs the model's ``forward``
once under stream capture for each batch size (``vllm/compilation/cuda_graph.py``,
``CUDAGraphWrapper``) and nano-vllm does the same in its runner (``capture_cudagraph``);
each later step copies its inputs into the captured input buffers and replays the graph.

:class:`DecodeCapture` is that idea on the CPU. Its first step runs the family's own
``forward`` with the layer ops and attention in *recording* mode: every kernel they launch is
run and appended to a :class:`Tape` as a call with all its arguments bound (the buffers
allocated during that forward become the step's fixed buffers), and the NumPy arithmetic the
model writes between the ops (``h + o``, ``qkv += bias``, Gemma's scalings, a soft-cap's
``tanh``) is recorded the same way by :class:`Traced`, an ndarray subclass whose
``__array_ufunc__`` binds each ufunc call to its output. A later step copies its token,
position, cache slot, block table and context length into the recorded input buffers, runs
the tape's checks and replays its calls: the same kernels with the same arguments as the
forward, so the logits are the same bits (``tests/kernels/test_captured_decode.py``). No
decoder layer is written twice: a family gets captured steps by having a ``forward``.

A recording holds while the step's shape does: the tape's checks (the attention backend's
work list for the new context, the numba thread count) say when it does not, and the step
is recorded again (a recording is an ordinary forward, so that step's logits are right too).
Bad inputs raise what the forward raises, before any kernel runs.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import numpy as np

from refengine.attention import AttentionMetadata


class NotCapturable(Exception):
    """The forward did something a recording cannot replay (a NumPy call other than a ufunc,
    an in-place reduction ...): the model's steps run the forward instead."""


class Tape:
    """The kernel calls of one recorded forward, in order, and the checks that say whether it still holds.

    Attributes:
        calls: calls of no arguments, each a kernel (or ufunc, or copy) with its arguments bound.
        checks: calls of no arguments run before a replay: each returns True while the recording
            holds for the inputs now in the fixed buffers, False when the step must be recorded
            again, or raises the forward's error for a bad input.
    """

    def __init__(self):
        self.calls: list[Callable[[], object]] = []
        self.checks: list[Callable[[], bool]] = []

    def record(self, fn: Callable, *args, **kwargs) -> None:
        """Append ``fn(*args, **kwargs)`` (already run by the caller) to :attr:`calls`."""
        self.calls.append(partial(fn, *args, **kwargs))

    def holds(self) -> bool:
        """Run every check: whether the calls may be replayed for the inputs now in place."""
        return all(check() for check in self.checks)

    def replay(self) -> None:
        for call in self.calls:
            call()


class Recordable:
    """Mixin of the layer ops and attention backends that can record: :meth:`_launch` runs a
    kernel and, while :attr:`tape` is set, appends it to the tape."""

    #: The :class:`Tape` being recorded, None outside a recording.
    tape: Tape | None = None

    def _launch(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)``; while recording, append the bound call to :attr:`tape`."""
        fn(*args)
        if self.tape is not None:
            self.tape.record(fn, *args)

    def _contiguous(self, x: np.ndarray, dtype=np.float32) -> np.ndarray:
        """``np.ascontiguousarray(x, dtype)``; a copy it makes is a recorded call too."""
        y = np.ascontiguousarray(x, dtype=dtype)
        if self.tape is not None and not np.may_share_memory(x, y):
            self.tape.record(np.copyto, y, x, casting="unsafe")
        return y


def _plain(value):
    """A :class:`Traced` array as the plain ndarray over the same memory; anything else as is."""
    return value.view(np.ndarray) if isinstance(value, Traced) else value


def _traced(value, tape: Tape):
    """ndarrays (alone or in a tuple) as :class:`Traced` views recording into ``tape``."""
    if isinstance(value, tuple):
        return tuple(_traced(v, tape) for v in value)
    if isinstance(value, np.ndarray):
        out = value.view(Traced)
        out.tape = tape
        return out
    return value


def _gather(source: np.ndarray, index, out: np.ndarray) -> None:
    out[...] = source[index]


def _reshape_into(source: np.ndarray, shape: tuple, out: np.ndarray) -> None:
    out[...] = source.reshape(shape)


class Traced(np.ndarray):
    """An activation of a forward being recorded: NumPy arithmetic on it is recorded on its tape.

    A ufunc call with a traced operand runs on the plain arrays, and its call, bound to the
    output it allocated (or was given), goes to :attr:`tape`; the result is traced. Views
    (slices, reshapes that need no copy, ``astype`` to the same dtype) share the recorded
    buffer and need nothing; indexing or reshaping that copies is recorded as a copy. Any
    other NumPy function raises :class:`NotCapturable`.
    """

    tape: Tape | None = None

    def __array_finalize__(self, obj):
        self.tape = getattr(obj, "tape", None)

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        tape = self.tape
        if method != "__call__" or tape is None:
            raise NotCapturable(f"{ufunc.__name__}.{method} in a recorded forward")
        args = tuple(_plain(a) for a in inputs)
        if out is None:
            result = ufunc(*args, **kwargs)
            outs = result if isinstance(result, tuple) else (result,)
        else:
            outs = tuple(_plain(o) for o in out)
            result = ufunc(*args, out=outs, **kwargs)
        if not all(isinstance(o, np.ndarray) for o in outs):
            raise NotCapturable(f"{ufunc.__name__} gave a scalar in a recorded forward")
        tape.record(ufunc, *args, out=outs, **kwargs)
        return _traced(result, tape)

    def __array_function__(self, func, types, args, kwargs):
        raise NotCapturable(f"numpy.{func.__name__} in a recorded forward")

    def _copied(self, out: np.ndarray, fn: Callable, *args):
        """``out`` (a result computed from this array) traced, its computation recorded if it is a copy."""
        source = self.view(np.ndarray)
        if not np.may_share_memory(out, source):
            self.tape.record(fn, source, *args, out)
        return _traced(out, self.tape)

    def __getitem__(self, index):
        index = tuple(_plain(i) for i in index) if isinstance(index, tuple) else _plain(index)
        out = self.view(np.ndarray)[index]
        if not isinstance(out, np.ndarray):
            raise NotCapturable("a scalar read from an activation in a recorded forward")
        return self._copied(out, _gather, index)

    def reshape(self, *shape, **kwargs):
        out = self.view(np.ndarray).reshape(*shape, **kwargs)
        return self._copied(out, _reshape_into, out.shape)

    def astype(self, dtype, *args, **kwargs):
        out = self.view(np.ndarray).astype(dtype, *args, **kwargs)
        return self._copied(out, lambda source, o: np.copyto(o, source, casting="unsafe"))

    def copy(self, order="C"):
        raise NotCapturable("a copy of an activation in a recorded forward")


class _Recording:
    """A layer-ops or attention object seen by a forward being recorded: arguments go in as
    plain arrays, array results come back :class:`Traced`; the object records its own
    kernels on its ``tape`` (:class:`Recordable`)."""

    def __init__(self, target, tape: Tape):
        self._target, self._tape = target, tape

    def __getattr__(self, name):
        value = getattr(self._target, name)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            result = value(*(_plain(a) for a in args), **{k: _plain(v) for k, v in kwargs.items()})
            return _traced(result, self._tape)

        return call


def _same_threads(threads: int) -> bool:
    from refengine.cpu.numba_support import get_num_threads

    return get_num_threads() == threads


class DecodeCapture:
    """A model's batch-1 decode steps, replayed from a recording of its own forward.

    Args:
        model: a model of any registered family whose ``ops`` and ``attention`` record
            (:class:`Recordable`: the numba layer ops and attention), in one process.
        kv_cache: its paged cache.
        max_model_len: the longest context a step may have (sizes the block-table buffer);
            by default the pool's tokens.

    Call it as the forward with one token: ``capture(input_ids [1], positions [1], meta)`` ->
    ``[1, vocab_size]`` float32 logits of that row, a fresh array.

    Raises (from a call, before any kernel runs; the forward's own errors for the same faults):
        ValueError: metadata of other than one sequence with one new token, a ``seq_len``
            outside ``[1, max_model_len]``, a block table without a block id inside the
            cache for each block of the context.
        IndexError: a position outside the RoPE tables, a slot outside the cache.
    """

    def __init__(self, model, kv_cache, max_model_len: int | None = None):
        self.model, self.kv_cache = model, kv_cache
        self.block_size = kv_cache.block_size
        pool = kv_cache.num_blocks * self.block_size
        self.max_model_len = min(pool, max_model_len or pool)
        max_blocks = -(-self.max_model_len // self.block_size)
        # the recorded inputs: each step copies its own into these
        self.input_ids = np.zeros(1, np.int64)
        self.positions = np.zeros(1, np.int64)
        self.rows = np.zeros(1, np.int64)  # the logits of row 0
        self.meta = AttentionMetadata(query_start_loc=np.array([0, 1], np.int32), seq_lens=np.ones(1, np.int32),
                                      block_tables=np.zeros((1, max_blocks), np.int32),
                                      slot_mapping=np.zeros(1, np.int32), max_query_len=1, max_seq_len=1)
        self.tape: Tape | None = None
        self._logits: np.ndarray | None = None
        #: Set when the forward did something a recording cannot replay: every step runs the forward.
        self.declined: str | None = None

    @classmethod
    def for_model(cls, model, kv_cache, max_model_len: int | None = None) -> "DecodeCapture | None":
        """A capture for ``model``, or None where its steps must run the forward: layer ops or
        attention that do not record, arrays other than NumPy's, a tensor-parallel share
        (its collectives are not kernels of the tape), a compute dtype other than float32."""
        if getattr(model, "tp", None) is not None or model.xp is not np or kv_cache.dtype != np.float32:
            return None
        if not (isinstance(model.ops, Recordable) and isinstance(model.attention, Recordable)):
            return None
        return cls(model, kv_cache, max_model_len)

    def __call__(self, input_ids: np.ndarray, positions: np.ndarray, meta: AttentionMetadata) -> np.ndarray:
        if meta.num_seqs != 1 or meta.num_tokens != 1 or len(input_ids) != 1:
            raise ValueError(f"a captured decode step takes one sequence with one new token, got "
                             f"{meta.num_seqs} sequences and {meta.num_tokens} tokens")
        seq_len = int(meta.seq_lens[0])
        if not 0 < seq_len <= self.max_model_len:
            raise ValueError(f"seq_len {seq_len} outside [1, max_model_len={self.max_model_len}]")
        if self.declined:
            return self.model.forward(input_ids, positions, self.kv_cache, meta, self.rows)
        table = np.asarray(meta.block_tables)[0]
        blocks = min(table.shape[0], self.meta.block_tables.shape[1])
        self.input_ids[0] = input_ids[0]
        self.positions[0] = positions[0]
        self.meta.seq_lens[0] = seq_len
        self.meta.slot_mapping[0] = meta.slot_mapping[0]
        self.meta.block_tables[0, :blocks] = table[:blocks]
        self.meta.block_tables[0, blocks:] = -1
        if self.tape is not None and self.tape.holds():
            self.tape.replay()
            return self._logits.copy()
        return self._record()

    def _record(self) -> np.ndarray:
        """Run the forward on the recorded inputs with the layer ops and attention recording;
        keep its tape and logits buffer. Returns the logits (a fresh array)."""
        from refengine.cpu.numba_support import get_num_threads

        model, tape = self.model, Tape()
        self.tape = None  # a recording that raises leaves none
        ops, attention = model.ops, model.attention
        tape.checks.append(partial(_same_threads, get_num_threads()))
        ops.tape = attention.tape = tape
        model.ops, model.attention = _Recording(ops, tape), _Recording(attention, tape)
        try:
            logits = model.forward(_traced(self.input_ids, tape), self.positions, self.kv_cache, self.meta,
                                   _traced(self.rows, tape))
        except NotCapturable as e:
            self.declined = str(e)
        finally:
            model.ops, model.attention = ops, attention
            ops.tape = attention.tape = None
        if self.declined:  # the K/V this forward wrote are the values the forward writes again
            return model.forward(self.input_ids.copy(), self.positions.copy(), self.kv_cache, self.meta, self.rows)
        self.tape, self._logits = tape, _plain(logits)
        return self._logits.copy()
