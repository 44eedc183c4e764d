"""``refengine bench kernels``: the numba CPU kernels against their NumPy twins and BLAS, at
the model's shapes (SmolLM2-135M by default).

Every row times both sides in the same process, interleaved, best of ``--repeats`` (wall
clock), and prints milliseconds and the ratio of the first side to the second (> 1: the
second is faster). Sections:

* ``kernels``: RMSNorm, RoPE, SiLU-and-mul, paged decode, flash prefill (numpy twin vs numba).
* ``linear``: ``NumbaOps.linear`` vs BLAS (``x @ w``) at 1-128 rows, over all layers' real
  weights in turn (so they come from DRAM as in a decode step), and the tied lm_head
  (``embed.T``); then the numba product's two register tiles against each other at 2-16
  rows (``DOT_4X4_MIN_ROWS``).
* ``step``: one model forward: decode at 1, 2 and 8 rows (context 256), a 512-token prefill.
* ``threads`` (``--threads``): the decode step in fresh processes under numba's threading
  policies, with the machine as it is and with a busy-loop process (``python -c 'while
  True: pass'``, started and killed here) taking a core.

No engine is built: the models are loaded bare, once per backend (the numba layout of the
weights differs from BLAS's), so the engine flags do not apply. Load from other processes
skews every number; the load average is printed before and after. The thread count adapts
to it (:func:`refengine.cpu.threads.adapt_threads`) before each round.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import click
import numpy as np

from refengine.bench.options import performance_md_option
from refengine.bench.report import write_performance

#: Which thread pool each side's calls get (``refengine.cpu.threads.adapt_threads(blas_step=...)``),
#: as the model runner would give a step of that kind: BLAS and the NumPy backend run on
#: BLAS's threads, the numba kernels below BLAS_MIN_ROWS on numba's.
BLAS_SIDES = {"numpy": True, "blas": True, "numba": False}
SECTIONS = ("kernels", "linear", "step")


def best_of(fns: dict, repeats: int, inner: int = 1, blas_step: dict | None = None) -> dict:
    """Best wall time (s) per call of each function, the functions interleaved; the thread
    count adapted to the machine's load, and the pools set as for a step of that side
    (``blas_step``: name -> bool, default :data:`BLAS_SIDES`), before each call."""
    from refengine.cpu.threads import adapt_threads

    sides = {**BLAS_SIDES, **(blas_step or {})}
    library = {k: not k.startswith("numba") for k in fns}  # the numba side spreads BLAS over its own threads
    for k, f in fns.items():
        adapt_threads(blas_step=sides.get(k), library_blas=library[k])
        f()
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            adapt_threads(blas_step=sides.get(k), library_blas=library[k])
            t = time.perf_counter()
            for _ in range(inner):
                f()
            best[k] = min(best[k], (time.perf_counter() - t) / inner)
    return best


class Rows:
    """The printed rows, kept for the ``--performance-md`` table."""

    HEADERS = ["section", "case", "side a", "a ms", "side b", "b ms", "a / b"]

    def __init__(self):
        self.rows: list[list] = []
        self.section = ""

    def start(self, section: str, title: str) -> None:
        self.section = section
        click.echo(title)

    def row(self, name: str, t: dict, a: str, b: str) -> None:
        """One line: both sides' best time (``t``: side -> seconds) and their ratio."""
        click.echo(f"  {name:40s} {a} {t[a] * 1e3:9.3f} ms   {b} {t[b] * 1e3:9.3f} ms   {a}/{b} {t[a] / t[b]:6.2f}")
        self.rows.append([self.section, name, a, t[a] * 1e3, b, t[b] * 1e3, t[a] / t[b]])


def load_model(model_dir: str, backend: str):
    """The model of ``model_dir`` with ``backend``'s attention and layer operations, no engine."""
    from refengine.attention.selector import get_attention_backend
    from refengine.engine_args import EngineArgs
    from refengine.models import load_model as load
    from refengine.ops import get_layer_ops

    model_dir, config = EngineArgs(model=model_dir).model_config()
    return load(model_dir, config, get_attention_backend(backend), get_layer_ops(backend))


def attention_batch(rng, seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                    block_size: int):
    """One attention batch: ``seqs`` is ``(seq_len, q_len)`` per sequence, its first
    ``seq_len - q_len`` tokens cached. Returns ``(q [T, Hq, D], k_new, v_new [T, Hkv, D],
    k_cache, v_cache [blocks, block_size, Hkv, D], meta)``, float32, the cache random and
    its blocks shuffled (:func:`refengine.bench.forward.shuffled_block_tables`)."""
    from refengine.attention import paged_metadata
    from refengine.bench.forward import shuffled_block_tables

    seq_lens = np.array([s for s, _ in seqs], np.int32)
    q_lens = np.array([q for _, q in seqs], np.int32)
    block_tables = shuffled_block_tables(rng, len(seqs), int(seq_lens.max()), block_size)
    meta = paged_metadata(q_lens, seq_lens, block_tables, block_size)
    cache = (block_tables.size, block_size, num_kv_heads, head_dim)
    new = (int(q_lens.sum()), num_kv_heads, head_dim)
    return (rng.standard_normal((new[0], num_heads, head_dim), dtype=np.float32),
            rng.standard_normal(new, dtype=np.float32), rng.standard_normal(new, dtype=np.float32),
            rng.standard_normal(cache, dtype=np.float32), rng.standard_normal(cache, dtype=np.float32), meta)


def section_kernels(model, repeats: int, out: Rows) -> None:
    from refengine.attention.numpy_ref import NumpyAttention
    from refengine.cpu.attention import NumbaAttention
    from refengine.cpu.layer_ops import NumbaOps
    from refengine.ops.numpy_ops import NumpyOps

    cfg = model.config
    nb, ref = NumbaOps(), NumpyOps()
    rng = np.random.default_rng(0)
    out.start("kernels", "kernels (numpy twin vs numba)")
    w = model.layers[0].input_norm
    for rows in (1, 8, 512):
        x = rng.standard_normal((rows, cfg.hidden_size), dtype=np.float32)
        out.row(f"rms_norm {rows}x{cfg.hidden_size}",
                best_of({"numpy": lambda: ref.rms_norm(x, w, 1e-5), "numba": lambda: nb.rms_norm(x, w, 1e-5)},
                        repeats, 50 if rows < 512 else 5), "numpy", "numba")
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for rows in (1, 8, 512):
        qkv = rng.standard_normal((rows, (hq + 2 * hkv) * hd), dtype=np.float32)
        q = qkv[:, :hq * hd].reshape(rows, hq, hd)
        k = qkv[:, hq * hd:(hq + hkv) * hd].reshape(rows, hkv, hd)
        pos = (np.arange(rows, dtype=np.int64) + 100) % cfg.max_position_embeddings  # inside the RoPE table
        out.row(f"rope {rows} tokens",
                best_of({"numpy": lambda: ref.rope(q, k, pos, model.rope),
                         "numba": lambda: nb.rope(q, k, pos, model.rope)}, repeats, 50 if rows < 512 else 5),
                "numpy", "numba")
    for rows in (1, 8, 64):
        x = rng.standard_normal((rows, 2 * cfg.intermediate_size), dtype=np.float32)
        out.row(f"silu_and_mul {rows}x{2 * cfg.intermediate_size}",
                best_of({"numpy": lambda: ref.silu_and_mul(x), "numba": lambda: nb.silu_and_mul(x)}, repeats, 20),
                "numpy", "numba")
    cases = {"decode 1 seq, ctx 512": [(512, 1)], "decode 8 seqs, ctx 512": [(512, 1)] * 8,
             "decode 1 seq, ctx 2000": [(2000, 1)], "prefill 128": [(128, 128)], "prefill 512": [(512, 512)],
             "chunk 64 rows, ctx 1000": [(1000, 64)], "4 decode + 2 prefill 48": [(300, 1)] * 4 + [(48, 48)] * 2}
    for name, seqs in cases.items():
        q, k_new, v_new, k_cache, v_cache, meta = attention_batch(rng, seqs, hq, hkv, hd, 16)
        twin, numba_be = NumpyAttention(), NumbaAttention()
        for be in (twin, numba_be):
            be.prepare(meta)
            be.write_kv(k_cache, v_cache, k_new, v_new, meta)
        inner = 20 if "decode" in name else 2
        out.row(f"attention {name}",
                best_of({"numpy": lambda: twin.forward(q, k_cache, v_cache, meta, model.scale),
                         "numba": lambda: numba_be.forward(q, k_cache, v_cache, meta, model.scale)},
                        repeats, inner), "numpy", "numba")


def section_linear(model_np, model_nb, repeats: int, out: Rows) -> None:
    """The layer products and the tied lm_head, each side with the weights in its own layout
    (``LayerOps.weight``: ``[in, out]`` rows for BLAS, ``[out, in]`` rows for numba)."""
    cfg = model_np.config
    rng = np.random.default_rng(1)

    def matrices(model):
        return [w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    ws_np, ws_nb = matrices(model_np), matrices(model_nb)
    out.start("linear", f"linear (BLAS x @ w vs numba): all {len(ws_np)} layer matrices in turn, weights from DRAM")
    for rows in (1, 2, 4, 8, 16, 32, 64, 128):
        xs = {n: rng.standard_normal((rows, n), dtype=np.float32) for n in (cfg.hidden_size, cfg.intermediate_size)}

        def blas():
            for w in ws_np:
                xs[w.shape[0]] @ w

        def numba_():
            for w in ws_nb:
                model_nb.ops.linear(xs[w.shape[0]], w)

        out.row(f"{rows:3d} rows, {len(ws_np)} matrices", best_of({"blas": blas, "numba": numba_}, repeats),
                "blas", "numba")
    for rows in (1, 2, 4, 8, 16, 32, 64, 128):
        x = rng.standard_normal((rows, cfg.hidden_size), dtype=np.float32)
        out.row(f"{rows:3d} rows, lm_head embed.T {tuple(model_nb.lm_head.shape)}",
                best_of({"blas": lambda: x @ model_np.lm_head,
                         "numba": lambda: model_nb.ops.linear(x, model_nb.lm_head)}, repeats), "blas", "numba")
    from refengine.cpu.layer_ops import matmul_dot

    for rows in (2, 4, 8, 16):
        xs = {n: rng.standard_normal((rows, n), dtype=np.float32) for n in (cfg.hidden_size, cfg.intermediate_size)}
        fns = {t: (lambda t=t: [matmul_dot(xs[w.shape[0]], w, t == "4x4") for w in ws_nb]) for t in ("4x1", "4x4")}
        out.row(f"{rows:3d} rows, {len(ws_nb)} matrices, tiles",
                best_of(fns, repeats, blas_step={"4x1": False, "4x4": False}), "4x1", "4x4")
        x = xs[cfg.hidden_size]
        fns = {t: (lambda t=t: matmul_dot(x, model_nb.lm_head, t == "4x4")) for t in ("4x1", "4x4")}
        out.row(f"{rows:3d} rows, lm_head, tiles", best_of(fns, repeats, blas_step={"4x1": False, "4x4": False}),
                "4x1", "4x4")


def _random_cache(model, num_blocks: int, block_size: int):
    from refengine.attention.kv_cache import KVCache

    cfg = model.config
    kv = KVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    rng = np.random.default_rng(2)
    for a in kv.k + kv.v:
        a[:] = rng.standard_normal(a.shape, dtype=np.float32)
    return kv


def decode_inputs(model, rows: int, ctx: int, block_size: int = 16):
    """``(token ids, positions, kv, meta)`` of a decode step: ``rows`` sequences of ``ctx``
    tokens, the last one new (a random cache holds the others)."""
    from refengine.attention import paged_metadata

    per = -(-ctx // block_size)
    kv = _random_cache(model, rows * per, block_size)
    bt = np.arange(rows * per, dtype=np.int32).reshape(rows, per)
    meta = paged_metadata(np.ones(rows, np.int32), np.full(rows, ctx, np.int32), bt, block_size)
    return np.arange(rows) + 100, np.full(rows, ctx - 1, np.int64), kv, meta


def prefill_inputs(model, n: int, block_size: int = 16):
    """``(token ids, positions, kv, meta)`` of one prefill of ``n`` tokens from position 0."""
    from refengine.attention import paged_metadata
    from refengine.attention.kv_cache import KVCache

    cfg = model.config
    per = -(-n // block_size)
    kv = KVCache(cfg.num_hidden_layers, per, block_size, cfg.num_key_value_heads, cfg.head_dim)
    meta = paged_metadata(np.array([n], np.int32), np.array([n], np.int32), np.arange(per, dtype=np.int32)[None],
                          block_size)
    return np.arange(n) % 1000 + 100, np.arange(n, dtype=np.int64), kv, meta


def section_step(model_np, model_nb, repeats: int, out: Rows) -> None:
    out.start("step", "model forward (numpy backend vs numba backend)")
    steps = {}
    for rows in (1, 2, 8):
        ids, pos, kv, meta = decode_inputs(model_np, rows, 256)
        last = np.arange(rows)
        t = best_of({"numpy": lambda: model_np.forward(ids, pos, kv, meta, last),
                     "numba": lambda: model_nb.forward(ids, pos, kv, meta, last)}, repeats)
        steps[rows] = t
        out.row(f"decode step, {rows} rows, ctx 256", t, "numpy", "numba")
    for rows in (2, 8):
        click.echo(f"  {rows}-row step / 1-row step: numpy {steps[rows]['numpy'] / steps[1]['numpy']:.2f}, "
                   f"numba {steps[rows]['numba'] / steps[1]['numba']:.2f}")
    click.echo(f"  batch-1 decode: numpy {1 / steps[1]['numpy']:.1f} tok/s, numba {1 / steps[1]['numba']:.1f} tok/s")
    ids, pos, kv, meta = prefill_inputs(model_np, 512)
    last = np.array([511])
    out.row("prefill 512 tokens", best_of({"numpy": lambda: model_np.forward(ids, pos, kv, meta, last),
                                          "numba": lambda: model_nb.forward(ids, pos, kv, meta, last)},
                                         max(2, repeats // 2), blas_step={"numba": True}), "numpy", "numba")


THREAD_POLICIES = {  # name: (environment, num_threads for configure_threads; None = adaptive)
    "2 threads, omp, GOMP_SPINCOUNT=300000 (threads.py, libgomp's default)": ({"NUMBA_THREADING_LAYER": "omp"}, 2),
    "2 threads, omp, GOMP_SPINCOUNT=100000": ({"NUMBA_THREADING_LAYER": "omp", "GOMP_SPINCOUNT": "100000"}, 2),
    "2 threads, omp, GOMP_SPINCOUNT=2000": ({"NUMBA_THREADING_LAYER": "omp", "GOMP_SPINCOUNT": "2000"}, 2),
    "2 threads, omp, passive": ({"NUMBA_THREADING_LAYER": "omp", "OMP_WAIT_POLICY": "PASSIVE"}, 2),
    "2 threads, workqueue": ({"NUMBA_THREADING_LAYER": "workqueue"}, 2),
    "1 thread (serial kernels)": ({}, 1),
    "adaptive (threads.py default)": ({}, None),
}


def thread_child(model_dir: str, repeats: int, num_threads: int | None) -> None:
    """One policy, in this fresh process: decode steps at 1 and 8 rows, as is, then with a
    busy loop; ``adapt_threads`` before each step, as the model runner calls it. Prints one
    JSON line: the threading layer, the threads used per phase, ``{case: (best ms, median ms)}``."""
    from refengine.cpu import setup_cpu_runtime
    from refengine.cpu.threads import adapt_threads, configure_threads, numba_threading_layer

    setup_cpu_runtime()  # numba's layer with the policy this process's environment names
    configure_threads(num_threads)
    model = load_model(model_dir, "numba")
    res, used = {}, {}
    for phase in ("as is", "busy"):
        busy = None
        if phase == "busy":
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(1.2)  # one adapt interval with (or without) the busy loop
            for rows in (1, 8):
                ids, pos, kv, meta = decode_inputs(model, rows, 256)
                last = np.arange(rows)
                model.forward(ids, pos, kv, meta, last)
                ts = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    used[phase] = adapt_threads(blas_step=False)  # a decode step: numba's pool
                    model.forward(ids, pos, kv, meta, last)
                    ts.append(time.perf_counter() - t)
                res[f"{phase} {rows}r"] = (min(ts) * 1e3, float(np.median(ts)) * 1e3)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    print(json.dumps({"layer": numba_threading_layer(), "threads": used, "ms": res}))


def section_threads(model_dir: str, repeats: int) -> list[list]:
    """Each policy of :data:`THREAD_POLICIES` in a fresh process; returns the table rows."""
    click.echo("decode step ms (best/median) per numba threading policy, each in a fresh process;"
               " 'busy': with a busy-loop process")
    rows = []
    for name, (env, threads) in THREAD_POLICIES.items():
        full = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        full.update(env)
        code = f"from refengine.bench.kernels import thread_child; thread_child({model_dir!r}, {repeats}, {threads!r})"
        out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True)
        if out.returncode != 0:
            raise click.ClickException(f"the {name!r} process failed: {out.stderr.strip()[-2000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        cells = "  ".join(f"{k} {b:6.1f}/{m:6.1f}" for k, (b, m) in r["ms"].items())
        used = "/".join(str(v) for v in r["threads"].values())
        click.echo(f"  {name:40s} [{r['layer']:9s} threads {used}]  {cells}")
        rows.append([name, r["layer"], used] + [f"{b:.1f} / {m:.1f}" for b, m in r["ms"].values()])
    return rows


def _sections(ctx, param, value: str) -> list[str]:
    wanted = [s for s in value.split(",") if s]
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
        raise click.BadParameter(f"{', '.join(unknown)}: the sections are {', '.join(SECTIONS)}", ctx, param)
    return wanted


@click.command("kernels")
@click.option("--model", "model_dir", default=None, show_default="$REFENGINE_MODEL or weights/SmolLM2-135M-Instruct",
              help="Model directory whose shapes and weights are timed.")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timed rounds per row (the best is reported).")
@click.option("--sections", default=",".join(SECTIONS), show_default=True, callback=_sections,
              help="Comma-separated sections to run (an empty string runs none).")
@click.option("--threads", "threads_study", is_flag=True, show_default="off",
              help="Also the threading-policy study: the decode step in fresh processes (slow).")
@performance_md_option
def kernels_cmd(model_dir, repeats, sections, threads_study, performance_md):
    """The numba CPU kernels against their NumPy twins and BLAS, at the model's shapes."""
    from refengine.cpu import setup_cpu_runtime
    from refengine.cpu.threads import adapt_threads, configure_threads, numba_threading_layer
    from refengine.engine_args import resolve_model_dir

    model_dir = str(resolve_model_dir(model_dir))
    setup_cpu_runtime()
    threads = configure_threads(None)
    out = Rows()
    if sections:
        model_np = load_model(model_dir, "numpy")
        model_nb = load_model(model_dir, "numba")  # its own weights: the numba layout differs from BLAS's
    click.echo(f"load average before: {os.getloadavg()}; {threads} threads; numba layer {numba_threading_layer()}")
    if "kernels" in sections:
        section_kernels(model_np, repeats, out)
    if "linear" in sections:
        section_linear(model_np, model_nb, repeats, out)
    if "step" in sections:
        section_step(model_np, model_nb, repeats, out)
    policy_rows = section_threads(model_dir, repeats) if threads_study else []
    click.echo(f"load average after: {os.getloadavg()}; threads at the end: {adapt_threads()}")
    body = [f"{os.path.basename(model_dir.rstrip('/'))}'s shapes, best of {repeats}, both sides interleaved; "
            "a / b > 1: side b is faster."]
    if out.rows:
        body.append((Rows.HEADERS, out.rows))
    if policy_rows:
        body += ["Decode step ms (best / median) per numba threading policy, each in a fresh process; "
                 "'busy': with a busy-loop process taking a core.",
                 (["policy", "layer", "threads"] + ["as is 1 row", "as is 8 rows", "busy 1 row", "busy 8 rows"],
                  policy_rows)]
    write_performance(performance_md, "bench kernels", body, echo=click.echo)
