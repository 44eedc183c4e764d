"""``refengine bench forward``: one forward pass at 1, 2, 4 ... rows against this machine's limits.

A row is one token in the flat batch. Up to ``decode_max_rows`` rows the pass is a decode
step: that many sequences, each with ``context_len`` tokens already cached, bring one
token each and all get logits. Above it the pass is one prefill chunk of that many
prompt tokens (positions ``0 .. rows - 1``), logits for its last row only. The KV cache is
the engine's own pool, addressed through shuffled block tables as a long-running engine
would leave them.

The limits are measured here, now, with the engine's thread count
(:mod:`refengine.bench.machine`):

* **memory bandwidth**: the best of a few sums over a 512 MiB float32 array (far larger
  than any cache), one part per thread, NumPy's SIMD sum in each (bytes read per second);
* **compute**: the best of a few float32 BLAS products ``[1024, 1024] @ [1024, 1024]``
  (``2 * 1024**3`` flops each).

The roofline time of a pass is ``max(bytes / bandwidth, flops / compute)`` with ``bytes``
every weight the pass reads once (the layer matrices, the norms, ``lm_head``; the
embedding table only for the rows looked up) plus the K and V the attention reads, and
``flops`` twice the multiply-adds of the matrix products plus attention's ``Q K^T`` and
``P V`` (causal for prefill). Williams, Waterman & Patterson 2009, "Roofline".
"""

from __future__ import annotations

import time

import numpy as np

from refengine.attention import paged_metadata
from refengine.bench.breakdown import PartTimer
from refengine.bench.machine import measure_bandwidth, measure_compute
from refengine.bench.report import format_table
from refengine.cpu.engine_hooks import is_blas_step
from refengine.cpu.threads import adapt_threads

#: Parts of a pass, in the table's order (a forward pass has no sampler).
FORWARD_PARTS = ("matmul", "lm_head", "attention", "elementwise", "python")


def pass_cost(model, rows: int, context_len: int, decode: bool) -> tuple[float, float]:
    """``(bytes, flops)`` one forward pass must at least move and compute (see the module docstring).

    Args:
        model: a loaded model (its weights are counted as they are held, in their dtype).
        rows: tokens in the pass.
        context_len: tokens already cached per decode row (unused for prefill).
        decode: ``rows`` sequences of one new token each (logits for all), else one prefill
            chunk from position 0 (logits for its last row).
    Returns:
        bytes read (weights once, embedding rows looked up, K/V in the cache dtype) and
        floating-point operations, both as floats.
    """
    cfg = model.config
    layer_bytes = sum(a.nbytes for layer in model.layers for a in vars(layer).values() if hasattr(a, "nbytes"))
    matrix_params = sum(int(np.prod(a.shape)) for layer in model.layers for a in vars(layer).values()
                        if len(getattr(a, "shape", ())) == 2)  # float arrays and quantized weights alike
    head = model.lm_head
    itemsize = model.embed.nbytes / np.prod(model.embed.shape)  # bytes per stored weight (quantized: fractional)
    logit_rows = rows if decode else 1
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * np.dtype(model.dtype).itemsize
    q_dims = cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    if decode:
        kv_tokens = rows * context_len
        attn_flops = 4 * rows * context_len * q_dims
    else:
        kv_tokens = rows
        attn_flops = 2 * rows * (rows + 1) * q_dims  # causal: row i reads i + 1 keys
    nbytes = layer_bytes + head.nbytes + model.norm.nbytes + rows * cfg.hidden_size * itemsize + kv_tokens * kv_per_token
    flops = 2 * rows * matrix_params + 2 * logit_rows * int(np.prod(head.shape)) + attn_flops
    return float(nbytes), float(flops)


def _blocks_needed(block_size: int, rows: int, context_len: int, decode: bool) -> int:
    return rows * -(-(context_len + 1) // block_size) if decode else -(-rows // block_size)


def _fill_cache(engine, num_blocks: int, rng) -> None:
    """Write random K and V into the first ``num_blocks`` blocks of every layer: the pages are
    then mapped (a fresh pool is lazily allocated; a first write would fault) and the
    softmax sees varied scores."""
    kv = engine.kv_cache
    for pool in (*kv.k, *kv.v):
        block = rng.standard_normal(pool.shape[1:], dtype=np.float32)
        pool[:num_blocks] = engine.model.xp.asarray(block.astype(pool.dtype))


def shuffled_block_tables(rng, num_seqs: int, max_seq_len: int, block_size: int) -> np.ndarray:
    """``[num_seqs, ceil(max_seq_len / block_size)]`` int32 block tables over blocks
    ``0 .. num_seqs * that - 1``, each block used once, in a random order: the pool as a
    long-running engine leaves it (a sequence's blocks are not neighbours). Every sequence
    gets the longest one's count; the entries past a shorter context are never read."""
    per_seq = -(-max_seq_len // block_size)
    return rng.permutation(num_seqs * per_seq).reshape(num_seqs, per_seq).astype(np.int32)


def _inputs(engine, rows: int, context_len: int, decode: bool, rng):
    """Token ids, positions, metadata and logit rows of one pass, on a fresh shuffle of
    the blocks :func:`_fill_cache` wrote."""
    kv = engine.kv_cache
    bs = kv.block_size
    if decode:
        q_lens = np.ones(rows, dtype=np.int32)
        seq_lens = np.full(rows, context_len + 1, dtype=np.int32)
        positions = np.full(rows, context_len, dtype=np.int64)
        logit_rows = np.arange(rows)
    else:
        q_lens = seq_lens = np.array([rows], dtype=np.int32)
        positions = np.arange(rows, dtype=np.int64)
        logit_rows = np.array([rows - 1])
    block_tables = shuffled_block_tables(rng, q_lens.shape[0], int(seq_lens.max()), bs)
    meta = paged_metadata(q_lens, seq_lens, block_tables, bs)
    ids = rng.integers(0, engine.model.config.vocab_size, size=int(q_lens.sum()), dtype=np.int64)
    return ids, positions, meta, logit_rows


def run_forward_bench(engine, rows_list, context_len: int, decode_max_rows: int, repeats: int,
                      echo=print) -> dict:
    """Time one forward pass per entry of ``rows_list`` (best of ``repeats`` after one warm-up
    pass) with its parts, against the measured limits; print and return the table.

    Returns:
        ``{"memory_bandwidth_bytes_per_s", "compute_flops_per_s", "context_len", "repeats",
        "passes"}``; each pass ``{"rows", "kind" ("decode"/"prefill"), "ms", "tokens_per_s",
        "roofline_ms", "bound" ("memory"/"compute"), "parts_ms": {part: ms}}``.
    Raises:
        ValueError: the pool has too few KV blocks for a row count at ``context_len``.
    """
    model = engine.model
    xp = model.xp
    rng = np.random.default_rng(0)
    blocks = max(_blocks_needed(engine.kv_cache.block_size, r, context_len, r <= decode_max_rows) for r in rows_list)
    if blocks > engine.kv_cache.num_blocks:
        raise ValueError(f"the largest pass needs {blocks} KV blocks at a context of {context_len} tokens; the pool "
                         f"has {engine.kv_cache.num_blocks} (raise --kv-cache-memory or --gpu-memory-utilization)")
    _fill_cache(engine, blocks, rng)
    if xp is np:
        adapt_threads(blas_step=True)  # BLAS with every thread for the compute limit
    bandwidth, compute = measure_bandwidth(), measure_compute()
    echo(f"this machine, now: memory read bandwidth {bandwidth / 1e9:.1f} GB/s, "
         f"float32 BLAS {compute / 1e9:.1f} GFLOP/s")
    results = []
    for rows in rows_list:
        decode = rows <= decode_max_rows
        inputs = [_inputs(engine, rows, context_len, decode, rng) for _ in range(repeats + 1)]
        best, parts = None, None
        for i, (ids, positions, meta, logit_rows) in enumerate(inputs):
            if xp is np:  # the thread pools as the model runner sets them for a step of this many rows
                adapt_threads(blas_step=is_blas_step(model, rows, 1 if rows <= decode_max_rows else rows))
            with PartTimer(model) as timer:
                t0 = time.perf_counter()
                model.forward(xp.asarray(ids), positions, engine.kv_cache, meta, xp.asarray(logit_rows))
                if xp is not np:
                    xp.cuda.get_current_stream().synchronize()
                elapsed = time.perf_counter() - t0
            if i and (best is None or elapsed < best):  # pass 0 warms up
                best, parts = elapsed, dict(timer.current)
        parts["python"] = max(0.0, best - sum(parts.values()))
        nbytes, flops = pass_cost(model, rows, context_len, decode)
        bound = max(nbytes / bandwidth, flops / compute)
        results.append({"rows": rows, "kind": "decode" if decode else "prefill", "ms": 1e3 * best,
                        "tokens_per_s": rows / best, "roofline_ms": 1e3 * bound,
                        "bound": "memory" if nbytes / bandwidth >= flops / compute else "compute",
                        "parts_ms": {p: 1e3 * parts.get(p, 0.0) for p in FORWARD_PARTS}})
    echo(f"one forward pass, decode rows at a context of {context_len} tokens, best of {repeats}")
    echo(format_table(*forward_table(results)))
    return {"memory_bandwidth_bytes_per_s": bandwidth, "compute_flops_per_s": compute,
            "context_len": context_len, "repeats": repeats, "passes": results}


def forward_table(passes: list[dict]) -> tuple[list[str], list[list]]:
    """``(headers, rows)`` of the printed table, one row per pass of :func:`run_forward_bench`
    (times in ms; "vs 1 row" only when a 1-row pass was timed)."""
    one = next((r["ms"] for r in passes if r["rows"] == 1), None)
    rows = [[r["rows"], r["kind"], r["ms"], f"x{r['ms'] / one:.2f}" if one else "-", r["tokens_per_s"],
             r["roofline_ms"], r["bound"], f"{100 * r['roofline_ms'] / r['ms']:.0f}%"]
            + [r["parts_ms"][p] for p in FORWARD_PARTS] for r in passes]
    headers = ["rows", "kind", "ms", "vs 1 row", "tok/s", "roofline ms", "bound", "of roofline"]
    return headers + [f"{p} ms" for p in FORWARD_PARTS], rows
