"""Where a step's time goes: matrix products, attention, elementwise layers, sampler, the rest.

:class:`StepBreakdown` wraps, for as long as it is entered, the layer operations
(:mod:`refengine.ops`), the attention backend and the sampler of one engine with timers,
and times every ``engine.step``. The rest of a step (scheduler, batch building, the
embedding lookup, stop rules, detokenizing, metrics: Python) is the step's time minus
the timed parts. Steps that run any prompt tokens count as prefill steps, the others as
decode steps; the two are reported apart (their costs differ by orders of magnitude).
``refengine bench SCENARIO --breakdown`` prints the table.

The timers add two ``perf_counter`` calls per wrapped call (~0.2 us; a decode step of
SmolLM2 makes ~300 such calls). On a GPU each timed call synchronises the stream first,
so GPU time lands in the part that spent it; that serialises the host and the device,
so step times there are longer than without ``--breakdown``.
"""

from __future__ import annotations

import time
from collections import defaultdict

#: The parts of a step, in the table's order.
PARTS = ("matmul", "lm_head", "attention", "elementwise", "sampler", "python")

_DESCRIPTIONS = {
    "matmul": "layer matrix products (qkv, o, gate_up, down)",
    "lm_head": "final matrix product to the vocabulary",
    "attention": "attention: prepare, KV-cache write, kernel",
    "elementwise": "RMSNorm, RoPE, SiLU-and-mul",
    "sampler": "sampler (processors, softmax, draw, logprobs)",
    "python": "the rest: scheduler, batch, embedding, stop rules, detokenizer",
}


class _TimedOps:
    """The layer operations of a model with each call timed into ``owner``."""

    def __init__(self, ops, owner: PartTimer, lm_head):
        self._ops, self._owner, self._lm_head = ops, owner, lm_head

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def linear(self, x, w):
        return self._owner.timed("lm_head" if w is self._lm_head else "matmul", self._ops.linear, x, w)

    def rms_norm(self, x, weight, eps):
        return self._owner.timed("elementwise", self._ops.rms_norm, x, weight, eps)

    def rope(self, q, k, positions, rope):
        return self._owner.timed("elementwise", self._ops.rope, q, k, positions, rope)

    def silu_and_mul(self, x):
        return self._owner.timed("elementwise", self._ops.silu_and_mul, x)


class PartTimer:
    """Times the layer operations and the attention backend of ``model`` while entered.

    ``current`` maps a part (``matmul``, ``lm_head``, ``attention``, ``elementwise``, and
    whatever else :meth:`timed` is given) to the seconds spent since it was last cleared.
    """

    def __init__(self, model):
        self.model = model
        self.current: dict[str, float] = defaultdict(float)
        xp = model.xp
        self._sync = None if xp.__name__ == "numpy" else xp.cuda.get_current_stream().synchronize
        self._saved: list[tuple[object, str, object]] = []

    def timed(self, part: str, fn, *args, **kwargs):
        """Call ``fn(*args, **kwargs)``, adding its wall time (after a GPU sync) to ``part``."""
        if self._sync is not None:
            self._sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if self._sync is not None:
            self._sync()
        self.current[part] += time.perf_counter() - t0
        return out

    def patch(self, obj, name: str, value) -> None:
        """Set ``obj.name = value`` until exit."""
        self._saved.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, value)

    def __enter__(self):
        model = self.model
        self.patch(model, "ops", _TimedOps(model.ops, self, model.lm_head))
        attn = model.attention
        for name in ("prepare", "write_kv", "forward"):
            method = getattr(attn, name)
            self.patch(attn, name, lambda *a, _m=method, **kw: self.timed("attention", _m, *a, **kw))
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, old in reversed(self._saved):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self._saved.clear()


class _TimedSampler:
    """``sampler`` whose calls count as the ``sampler`` part; every other attribute (its
    ``check_sampling_params``, ``eos_token_ids``, ...) is the sampler's own."""

    def __init__(self, sampler, timer: PartTimer):
        self._sampler, self._timer = sampler, timer

    def __call__(self, *args, **kwargs):
        return self._timer.timed("sampler", lambda: self._sampler(*args, **kwargs))

    def __getattr__(self, name):
        return getattr(self._sampler, name)


class StepBreakdown(PartTimer):
    """Times the parts of every step ``engine`` runs while entered (a context manager).

    Args:
        engine: an :class:`refengine.core.engine.LLMEngine`.
    Attributes:
        seconds: ``"prefill"``/``"decode"`` -> part -> seconds spent (``python`` filled by
            :meth:`summary`).
        num_steps: step kind -> steps that scheduled work.
        step_seconds: step kind -> their total wall time.
    """

    KINDS = ("decode", "prefill")

    def __init__(self, engine):
        super().__init__(engine.model)
        self.engine = engine
        self.seconds = {kind: defaultdict(float) for kind in self.KINDS}
        self.num_steps = dict.fromkeys(self.KINDS, 0)
        self.step_seconds = dict.fromkeys(self.KINDS, 0.0)

    def __enter__(self) -> StepBreakdown:
        super().__enter__()
        engine = self.engine
        self.patch(engine, "sampler", _TimedSampler(engine.sampler, self))
        step = engine.step
        steps = engine.metrics.steps

        def timed_step():
            self.current.clear()
            last = steps[-1] if steps else None  # a bounded deque: compare records, not lengths
            t0 = time.perf_counter()
            out = step()
            elapsed = time.perf_counter() - t0
            if steps and steps[-1] is not last:  # an empty schedule records no step
                kind = "prefill" if steps[-1].num_prefill_tokens else "decode"
                self.num_steps[kind] += 1
                self.step_seconds[kind] += elapsed
                for part, sec in self.current.items():
                    self.seconds[kind][part] += sec
            return out

        self.patch(engine, "step", timed_step)
        return self

    def summary(self) -> dict:
        """Per step kind: ``{"num_steps", "step_ms_mean", "parts": {part: {"ms_per_step", "share"}}}``;
        ``python`` is the step time the other parts do not account for."""
        out = {}
        for kind in self.KINDS:
            seconds = {p: self.seconds[kind][p] for p in PARTS if p != "python"}
            seconds["python"] = max(0.0, self.step_seconds[kind] - sum(seconds.values()))
            n, total = max(self.num_steps[kind], 1), max(self.step_seconds[kind], 1e-12)
            out[kind] = {"num_steps": self.num_steps[kind], "step_ms_mean": 1e3 * self.step_seconds[kind] / n,
                         "parts": {p: {"ms_per_step": 1e3 * seconds[p] / n, "share": seconds[p] / total}
                                   for p in PARTS}}
        return out


def format_breakdown(summary: dict) -> str:
    """The table ``refengine bench --breakdown`` prints: ms per step and share, decode and prefill steps."""
    from refengine.bench.report import format_table

    kinds = [k for k in StepBreakdown.KINDS if summary[k]["num_steps"]]
    headers = ["part"] + [h for k in kinds for h in (f"{k} ms/step", "share")] + ["what"]
    rows = [[p] + [v for k in kinds for v in (summary[k]["parts"][p]["ms_per_step"],
                                               f"{100 * summary[k]['parts'][p]['share']:.1f}%")]
            + [_DESCRIPTIONS[p]] for p in PARTS]
    rows.append(["step"] + [v for k in kinds for v in (summary[k]["step_ms_mean"], "100%")]
                + [", ".join(f"{summary[k]['num_steps']} {k} steps" for k in kinds)])
    return "where a step's time goes\n" + format_table(headers, rows)


_MISSING = object()
