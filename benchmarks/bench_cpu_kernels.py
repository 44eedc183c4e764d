"""The numba CPU kernels against their NumPy twins and BLAS, at SmolLM2-135M's shapes.

Every row times both sides in the same process, interleaved, best of ``--repeats`` (wall
clock), and prints milliseconds and the ratio twin/numba (> 1: numba is faster). Sections:

* ``kernels``: RMSNorm, RoPE, SiLU-and-mul, paged decode, flash prefill.
* ``linear``: ``NumbaOps.linear`` vs BLAS (``x @ w``) at 1-128 rows, over all 30 layers'
  real weights in turn (425 MB, so they come from DRAM as in a decode step), and the tied
  lm_head (``embed.T``); then the numba product's two register tiles against each other
  at 2-16 rows (``DOT_4X4_MIN_ROWS``).
* ``step``: one model forward: decode at 1, 2 and 8 rows (context 256), a 512-token prefill.
* ``threads`` (``--threads``): the decode step in fresh processes under numba's threading
  policies, with the machine as it is and with a busy-loop process (``python -c 'while
  True: pass'``, started and killed here) taking a core.

Load from other processes skews every number; the load average is printed before and after.
The thread count adapts to it (``refengine.threads.adapt_threads``) before each round.

    python benchmarks/bench_cpu_kernels.py [--model DIR] [--repeats 5] [--sections kernels,linear,step] [--threads]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import click

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # as `import refengine` sets it (refengine/threads.py)

import numpy as np  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


#: Which thread pool each side's calls get (``refengine.threads.adapt_threads(blas_step=...)``),
#: as the model runner would give a step of that kind: BLAS and the NumPy backend run on
#: BLAS's threads, the numba kernels below BLAS_MIN_ROWS on numba's.
BLAS_SIDES = {"numpy": True, "blas": True, "numba": False}


def best_of(fns: dict, repeats: int, inner: int = 1, blas_step: dict | None = None) -> dict:
    """Best wall time (s) per call of each function, the functions interleaved; the thread
    count adapted to the machine's load, and the pools set as for a step of that side
    (``blas_step``: name -> bool, default :data:`BLAS_SIDES`), before each call."""
    from refengine.threads import adapt_threads

    sides = {**BLAS_SIDES, **(blas_step or {})}
    for k, f in fns.items():
        adapt_threads(blas_step=sides.get(k))
        f()
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            adapt_threads(blas_step=sides.get(k))
            t = time.perf_counter()
            for _ in range(inner):
                f()
            best[k] = min(best[k], (time.perf_counter() - t) / inner)
    return best


def row(name: str, t: dict, a: str, b: str) -> None:
    print(f"  {name:40s} {a} {t[a] * 1e3:9.3f} ms   {b} {t[b] * 1e3:9.3f} ms   {a}/{b} {t[a] / t[b]:6.2f}",
          flush=True)


def load_model(model_dir: str, backend: str):
    from refengine.attention import get_attention_backend
    from refengine.engine_args import EngineArgs
    from refengine.models import load_model as load
    from refengine.ops import get_layer_ops

    model_dir, config = EngineArgs(model=model_dir).model_config()
    return load(model_dir, config, get_attention_backend(backend), get_layer_ops(backend))


def section_kernels(model, repeats: int) -> None:
    from refengine.attention.numba_cpu import NumbaAttention
    from refengine.attention.numpy_ref import NumpyAttention
    from refengine.ops.numba_ops import NumbaOps
    from refengine.ops.numpy_ops import NumpyOps

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_cpu_kernels import make_batch

    cfg = model.config
    nb, ref = NumbaOps(), NumpyOps()
    rng = np.random.default_rng(0)
    print("kernels (numpy twin vs numba)")
    w = model.layers[0].input_norm
    for rows in (1, 8, 512):
        x = rng.standard_normal((rows, cfg.hidden_size), dtype=np.float32)
        row(f"rms_norm {rows}x{cfg.hidden_size}",
            best_of({"numpy": lambda: ref.rms_norm(x, w, 1e-5), "numba": lambda: nb.rms_norm(x, w, 1e-5)},
                    repeats, 50 if rows < 512 else 5), "numpy", "numba")
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for rows in (1, 8, 512):
        qkv = rng.standard_normal((rows, (hq + 2 * hkv) * hd), dtype=np.float32)
        q = qkv[:, :hq * hd].reshape(rows, hq, hd)
        k = qkv[:, hq * hd:(hq + hkv) * hd].reshape(rows, hkv, hd)
        pos = np.arange(rows, dtype=np.int64) + 100
        row(f"rope {rows} tokens",
            best_of({"numpy": lambda: ref.rope(q, k, pos, model.rope), "numba": lambda: nb.rope(q, k, pos, model.rope)},
                    repeats, 50 if rows < 512 else 5), "numpy", "numba")
    for rows in (1, 8, 64):
        x = rng.standard_normal((rows, 2 * cfg.intermediate_size), dtype=np.float32)
        row(f"silu_and_mul {rows}x{2 * cfg.intermediate_size}",
            best_of({"numpy": lambda: ref.silu_and_mul(x), "numba": lambda: nb.silu_and_mul(x)}, repeats, 20),
            "numpy", "numba")
    cases = {"decode 1 seq, ctx 512": [(512, 1)], "decode 8 seqs, ctx 512": [(512, 1)] * 8,
             "decode 1 seq, ctx 2000": [(2000, 1)], "prefill 128": [(128, 128)], "prefill 512": [(512, 512)],
             "chunk 64 rows, ctx 1000": [(1000, 64)], "4 decode + 2 prefill 48": [(300, 1)] * 4 + [(48, 48)] * 2}
    for name, seqs in cases.items():
        b = make_batch(rng, seqs, hq, hkv, hd, 16)
        b.k_cache[np.isnan(b.k_cache)] = 0.0
        b.v_cache[np.isnan(b.v_cache)] = 0.0
        twin, numba_be = NumpyAttention(), NumbaAttention()
        for be in (twin, numba_be):
            be.prepare(b.meta)
            be.write_kv(b.k_cache, b.v_cache, b.k_new, b.v_new, b.meta)
        inner = 20 if "decode" in name else 2
        row(f"attention {name}",
            best_of({"numpy": lambda: twin.forward(b.q, b.k_cache, b.v_cache, b.meta, model.scale),
                     "numba": lambda: numba_be.forward(b.q, b.k_cache, b.v_cache, b.meta, model.scale)},
                    repeats, inner), "numpy", "numba")


def section_linear(model_np, model_nb, repeats: int) -> None:
    """The layer products and the tied lm_head, each side with the weights in its own layout
    (``LayerOps.weight``: ``[in, out]`` rows for BLAS, ``[out, in]`` rows for numba)."""
    cfg = model_np.config
    rng = np.random.default_rng(1)

    def matrices(model):
        return [w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    ws_np, ws_nb = matrices(model_np), matrices(model_nb)
    print(f"linear (BLAS x @ w vs numba): all {len(ws_np)} layer matrices in turn, weights from DRAM")
    for rows in (1, 2, 4, 8, 16, 32, 64, 128):
        xs = {n: rng.standard_normal((rows, n), dtype=np.float32) for n in (cfg.hidden_size, cfg.intermediate_size)}

        def blas():
            for w in ws_np:
                xs[w.shape[0]] @ w

        def numba_():
            for w in ws_nb:
                model_nb.ops.linear(xs[w.shape[0]], w)

        row(f"{rows:3d} rows, {len(ws_np)} matrices", best_of({"blas": blas, "numba": numba_}, repeats), "blas", "numba")
    for rows in (1, 2, 4, 8, 16, 32, 64, 128):
        x = rng.standard_normal((rows, cfg.hidden_size), dtype=np.float32)
        row(f"{rows:3d} rows, lm_head embed.T {tuple(model_nb.lm_head.shape)}",
            best_of({"blas": lambda: x @ model_np.lm_head, "numba": lambda: model_nb.ops.linear(x, model_nb.lm_head)},
                    repeats), "blas", "numba")
    from refengine.ops.numba_ops import matmul_dot

    for rows in (2, 4, 8, 16):
        xs = {n: rng.standard_normal((rows, n), dtype=np.float32) for n in (cfg.hidden_size, cfg.intermediate_size)}
        fns = {t: (lambda t=t: [matmul_dot(xs[w.shape[0]], w, t == "4x4") for w in ws_nb]) for t in ("4x1", "4x4")}
        row(f"{rows:3d} rows, {len(ws_nb)} matrices, tiles", best_of(fns, repeats, blas_step={"4x1": False, "4x4": False}),
            "4x1", "4x4")
        x = xs[cfg.hidden_size]
        fns = {t: (lambda t=t: matmul_dot(x, model_nb.lm_head, t == "4x4")) for t in ("4x1", "4x4")}
        row(f"{rows:3d} rows, lm_head, tiles", best_of(fns, repeats, blas_step={"4x1": False, "4x4": False}), "4x1", "4x4")


def decode_inputs(model, rows: int, ctx: int, block_size: int = 16):
    from refengine.attention import AttentionMetadata
    from refengine.kv_cache import KVCache

    cfg = model.config
    per = -(-ctx // block_size)
    kv = KVCache(cfg.num_hidden_layers, rows * per, block_size, cfg.num_key_value_heads, cfg.head_dim)
    rng = np.random.default_rng(2)
    for a in kv.k + kv.v:
        a[:] = rng.standard_normal(a.shape, dtype=np.float32)
    bt = np.arange(rows * per, dtype=np.int32).reshape(rows, per)
    slots = bt[:, (ctx - 1) // block_size] * block_size + (ctx - 1) % block_size
    meta = AttentionMetadata(np.arange(rows + 1, dtype=np.int32), np.full(rows, ctx, np.int32), bt,
                             slots.astype(np.int32), 1, ctx)
    return np.arange(rows) + 100, np.full(rows, ctx - 1, np.int64), kv, meta


def prefill_inputs(model, n: int, block_size: int = 16):
    from refengine.attention import AttentionMetadata
    from refengine.kv_cache import KVCache

    cfg = model.config
    per = -(-n // block_size)
    kv = KVCache(cfg.num_hidden_layers, per, block_size, cfg.num_key_value_heads, cfg.head_dim)
    bt = np.arange(per, dtype=np.int32)[None]
    meta = AttentionMetadata(np.array([0, n], np.int32), np.array([n], np.int32), bt,
                             np.arange(n, dtype=np.int32), n, n)
    return np.arange(n) % 1000 + 100, np.arange(n, dtype=np.int64), kv, meta


def section_step(model_np, model_nb, repeats: int) -> None:
    print("model forward (numpy backend vs numba backend)")
    steps = {}
    for rows in (1, 2, 8):
        ids, pos, kv, meta = decode_inputs(model_np, rows, 256)
        last = np.arange(rows)
        t = best_of({"numpy": lambda: model_np.forward(ids, pos, kv, meta, last),
                     "numba": lambda: model_nb.forward(ids, pos, kv, meta, last)}, repeats)
        steps[rows] = t
        row(f"decode step, {rows} rows, ctx 256", t, "numpy", "numba")
    for rows in (2, 8):
        print(f"  {rows}-row step / 1-row step: numpy {steps[rows]['numpy'] / steps[1]['numpy']:.2f}, "
              f"numba {steps[rows]['numba'] / steps[1]['numba']:.2f}")
    print(f"  batch-1 decode: numpy {1 / steps[1]['numpy']:.1f} tok/s, numba {1 / steps[1]['numba']:.1f} tok/s")
    ids, pos, kv, meta = prefill_inputs(model_np, 512)
    last = np.array([511])
    row("prefill 512 tokens", best_of({"numpy": lambda: model_np.forward(ids, pos, kv, meta, last),
                                      "numba": lambda: model_nb.forward(ids, pos, kv, meta, last)},
                                     max(2, repeats // 2), blas_step={"numba": True}), "numpy", "numba")


THREAD_POLICIES = {  # name: (environment, num_threads for configure_threads; None = adaptive)
    "2 threads, omp, libgomp default spin": ({"NUMBA_THREADING_LAYER": "omp", "GOMP_SPINCOUNT": "300000"}, 2),
    "2 threads, omp, GOMP_SPINCOUNT=100000": ({"NUMBA_THREADING_LAYER": "omp", "GOMP_SPINCOUNT": "100000"}, 2),
    "2 threads, omp, GOMP_SPINCOUNT=2000 (threads.py)": ({"NUMBA_THREADING_LAYER": "omp"}, 2),
    "2 threads, omp, passive": ({"NUMBA_THREADING_LAYER": "omp", "OMP_WAIT_POLICY": "PASSIVE"}, 2),
    "2 threads, workqueue": ({"NUMBA_THREADING_LAYER": "workqueue"}, 2),
    "1 thread (serial kernels)": ({}, 1),
    "adaptive (threads.py default)": ({}, None),
}


def thread_child(model_dir: str, repeats: int) -> None:
    """One policy, in this fresh process: decode steps at 1 and 8 rows, as is, then with a
    busy loop; ``adapt_threads`` before each step, as the model runner calls it."""
    from refengine.threads import adapt_threads, configure_threads, numba_threading_layer

    n = os.environ.get("REFENGINE_BENCH_THREADS", "")
    configure_threads(int(n) if n else None)
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


def section_threads(model_dir: str, repeats: int) -> None:
    print("decode step ms (best/median) per numba threading policy, each in a fresh process;"
          " 'busy': with a busy-loop process")
    for name, (env, threads) in THREAD_POLICIES.items():
        full = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        full.update(env, REFENGINE_BENCH_THREADS="" if threads is None else str(threads))
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--model", model_dir, "--repeats",
                              str(repeats), "--thread-child"], env=full, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        cells = "  ".join(f"{k} {b:6.1f}/{m:6.1f}" for k, (b, m) in r["ms"].items())
        used = "/".join(str(v) for v in r["threads"].values())
        print(f"  {name:40s} [{r['layer']:9s} threads {used}]  {cells}", flush=True)


@click.command()
@click.option("--model", "model_dir", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
@click.option("--repeats", default=5, show_default=True)
@click.option("--sections", default="kernels,linear,step", show_default=True)
@click.option("--threads", "threads_study", is_flag=True, help="also the threading-policy study (slow)")
@click.option("--thread-child", "as_child", is_flag=True, hidden=True)
def main(model_dir, repeats, sections, threads_study, as_child):
    from refengine.engine_args import resolve_model_dir

    model_dir = str(resolve_model_dir(model_dir))
    if as_child:
        thread_child(model_dir, repeats)
        return
    from refengine.threads import configure_threads, numba_threading_layer

    threads = configure_threads(None)
    wanted = [s for s in sections.split(",") if s]
    if wanted:
        model_np = load_model(model_dir, "numpy")
        model_nb = load_model(model_dir, "numba")  # its own weights: the numba layout differs from BLAS's
    print(f"load average before: {os.getloadavg()}; {threads} threads; numba layer {numba_threading_layer()}")
    if "kernels" in wanted:
        section_kernels(model_np, repeats)
    if "linear" in wanted:
        section_linear(model_np, model_nb, repeats)
    if "step" in wanted:
        section_step(model_np, model_nb, repeats)
    if threads_study:
        section_threads(model_dir, repeats)
    from refengine.threads import current_threads

    print(f"load average after: {os.getloadavg()}; threads at the end: {current_threads()}")


if __name__ == "__main__":
    main()
