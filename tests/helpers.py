"""Helpers shared by the tests of every folder (``from tests.helpers import ...``: ``tests/``
is a package, so same-named files in two folders do not clash).

* :func:`make_case`: a random paged batch with NaN-guarded caches;
* :func:`dense_reference`, :func:`numpy_twin`, :func:`run_and_check`: the references an
  attention backend's output is compared with, at :data:`TOLERANCE`;
* :func:`fake_cupy`: a stand-in CuPy whose ``RawModule`` runs the CPU emulator;
* :func:`load_gpu_check`: ``benchmarks/gpu_check.py`` as a module;
* :func:`assert_logits_match`, :func:`assert_logits_close`, :func:`hf_greedy`: a model's
  logits and greedy tokens against a transformers model (float32, eager) on the same ids.
* :class:`ServerThread`, :func:`http_server`, :func:`client`, :func:`wait_until`,
  :func:`metric`: a server over loopback HTTP in this process, and what its tests read back;
* :func:`shuffled_block_tables`: a paged batch's block tables over shuffled physical blocks.
* :func:`random_adapter`: a PEFT LoRA adapter with random weights for a model directory.
* :func:`shared_models`: engines built inside it share their loaded model, with no warm-up;

Tolerances: float32 storage differs from the float64 reference only by float32
accumulation and exp rounding over at most a few hundred keys: rtol=atol=2e-5 is
generous. With float16/bfloat16 storage the reference is computed from the *same*
rounded inputs, so the remaining error is the final rounding of the output to the
storage type (half an ulp: 2^-11 relative for float16, 2^-8 for bfloat16) plus float32
noise: rtol=atol=2e-3 (float16) and 1e-2 (bfloat16). The tensor-core kernel also rounds
the probabilities to the storage type before P·V (as FlashAttention-2 does); those
roundings are unbiased and averaged over the keys, so the same bounds hold (observed
maxima: ~1e-3 for float16, ~9e-3 for bfloat16 on outputs of magnitude up to ~3). The NumPy
twin runs in float32 on the upcast inputs and gets the same tolerances.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from refengine.attention import AttentionMetadata, paged_metadata
from refengine.attention.numpy_ref import NumpyAttention

ROOT = Path(__file__).resolve().parents[1]
BF16 = np.dtype(ml_dtypes.bfloat16)
TOLERANCE = {np.dtype(np.float32): 2e-5, np.dtype(np.float16): 2e-3, BF16: 1e-2}

BLOCK_SIZE = 16
# Context lengths around block boundaries (1, bs-1, bs, bs+1) and one long one.
EDGE_LENGTHS = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 300]


@dataclass
class Case:
    q: np.ndarray  # [T, H, D] storage dtype
    k_new: np.ndarray  # [T, KVH, D] this step's keys (to write through write_kv)
    v_new: np.ndarray
    k_cache: np.ndarray  # [num_blocks, bs, KVH, D], a view inside a NaN-guarded buffer
    v_cache: np.ndarray
    meta: AttentionMetadata
    k_logical: list  # per sequence [seq_len, KVH, D] float64 (rounded to the storage dtype)
    v_logical: list
    q_lens: np.ndarray
    scale: float


def shuffled_block_tables(rng, seq_lens, block_size: int, spare_blocks: int) -> tuple[np.ndarray, int]:
    """Block tables for sequences of ``seq_lens`` tokens over ``sum(blocks) + spare_blocks``
    physical blocks handed out in a random order (``rng.permutation``, drawn first), with one
    column of pure padding (-1); returns ``(block_tables, num_blocks)``."""
    blocks_per_seq = [-(-int(s) // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    physical = rng.permutation(num_blocks)
    block_tables = np.full((len(seq_lens), max(blocks_per_seq) + 1), -1, np.int32)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = physical[start:start + n]
        start += n
    return block_tables, num_blocks


def make_case(rng, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, spare_blocks=3) -> Case:
    """Build a batch. ``seqs`` is a list of ``(seq_len, q_len)``; the first
    ``seq_len - q_len`` tokens of each are already in the cache, the rest are new."""
    dtype = np.dtype(dtype)
    seq_lens = np.array([s for s, _ in seqs], np.int32)
    q_lens = np.array([q for _, q in seqs], np.int32)
    block_tables, num_blocks = shuffled_block_tables(rng, seq_lens, block_size, spare_blocks)

    # Guard blocks before and after the cache: out-of-range reads see NaN.
    shape = (num_blocks + 2, block_size, num_kv_heads, head_dim)
    k_buf = np.full(shape, np.nan, np.float32).astype(dtype)
    v_buf = np.full(shape, np.nan, np.float32).astype(dtype)
    k_cache, v_cache = k_buf[1:-1], v_buf[1:-1]

    k_logical, v_logical, k_new, v_new = [], [], [], []
    for i, (seq_len, q_len) in enumerate(seqs):
        k = rng.standard_normal((seq_len, num_kv_heads, head_dim)).astype(np.float32).astype(dtype)
        v = rng.standard_normal((seq_len, num_kv_heads, head_dim)).astype(np.float32).astype(dtype)
        k_logical.append(k.astype(np.float64))
        v_logical.append(v.astype(np.float64))
        for pos in range(seq_len - q_len):  # cached by an earlier step
            block, offset = block_tables[i, pos // block_size], pos % block_size
            k_cache[block, offset] = k[pos]
            v_cache[block, offset] = v[pos]
        k_new.append(k[seq_len - q_len:])
        v_new.append(v[seq_len - q_len:])

    num_tokens = int(q_lens.sum())
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32).astype(dtype)
    meta = paged_metadata(q_lens, seq_lens, block_tables, block_size)
    return Case(q, np.concatenate(k_new), np.concatenate(v_new), k_cache, v_cache, meta, k_logical, v_logical,
                q_lens, 1.0 / np.sqrt(head_dim))


def mixed_batch():
    """Prefill-kernel batch: full prompts at block edges, chunked prefills (q_len <
    seq_len) including a long context, and decode rows (q_len 1) in the same batch."""
    return [(1, 1), (BLOCK_SIZE - 1, BLOCK_SIZE - 1), (BLOCK_SIZE, 5), (BLOCK_SIZE + 1, BLOCK_SIZE + 1),
            (300, 40), (37, 1), (33, 33)]


def decode_batch():
    """Decode-kernel batch: one new token per sequence, contexts at block edges."""
    return [(n, 1) for n in EDGE_LENGTHS] + [(100, 1)]


def heads_for(group: int) -> tuple[int, int]:
    """``(num_heads, num_kv_heads)`` with ``group`` query heads per KV head."""
    num_kv_heads = 2 if group <= 3 else 1
    return num_kv_heads * group, num_kv_heads


def dense_reference(case: Case, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None) -> np.ndarray:
    """Causal softmax attention per sequence in float64 from the logical K/V: a query at
    position ``p`` sees keys ``0 ..= p``, or ``p - W < key <= p`` with a sliding window ``W``
    (transformers' rule); soft-capped scores are ``c * tanh(s / c)``."""
    num_tokens, num_heads, head_dim = case.q.shape
    num_kv_heads = case.k_logical[0].shape[1]
    group = num_heads // num_kv_heads
    out = np.zeros((num_tokens, num_heads, head_dim))
    q_all = case.q.astype(np.float64)
    for i, q_len in enumerate(case.q_lens):
        start = case.meta.query_start_loc[i]
        seq_len = case.meta.seq_lens[i]
        positions = np.arange(seq_len - q_len, seq_len)
        keys = np.arange(seq_len)[None, :]
        mask = keys <= positions[:, None]  # [q_len, seq_len]
        if sliding_window is not None:
            mask &= keys > positions[:, None] - sliding_window
        for h in range(num_heads):
            kv = h // group
            s = q_all[start:start + q_len, h] @ case.k_logical[i][:, kv].T * case.scale
            if logits_soft_cap is not None:
                s = logits_soft_cap * np.tanh(s / logits_soft_cap)
            s = np.where(mask, s, -np.inf)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            out[start:start + q_len, h] = p @ case.v_logical[i][:, kv]
    return out


def numpy_twin(case: Case, **options) -> np.ndarray:
    """The NumPy backend on float32 copies of the same cache (NaN slots replaced by a
    finite value: the twin's decode path multiplies masked probabilities, which are
    exactly 0, by whatever the padding slots hold, and 0 * NaN would be NaN)."""
    k_cache = np.nan_to_num(case.k_cache.astype(np.float32), nan=1e4)
    v_cache = np.nan_to_num(case.v_cache.astype(np.float32), nan=1e4)
    return NumpyAttention().forward(case.q.astype(np.float32), k_cache, v_cache, case.meta, case.scale, **options)


def run_and_check(backend, case: Case, *, check_twin: bool = True, **options) -> np.ndarray:
    """write_kv then forward through the emulated kernels; compare with both references.
    ``options``: the attention's per-layer keywords (``sliding_window``, ``logits_soft_cap``)."""
    backend.write_kv(case.k_cache, case.v_cache, case.k_new, case.v_new, case.meta)
    out = backend.forward(case.q, case.k_cache, case.v_cache, case.meta, case.scale, **options)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    got = out.astype(np.float64)
    assert np.isfinite(got).all(), "kernel left NaN/inf in the output"
    tol = TOLERANCE[case.q.dtype]
    np.testing.assert_allclose(got, dense_reference(case, **options), rtol=tol, atol=tol)
    if check_twin:
        np.testing.assert_allclose(got, numpy_twin(case, **options), rtol=tol, atol=tol)
    return out


def fake_cupy():
    """A minimal stand-in for the parts of CuPy that CudaAttention and gpu_check use:
    arrays are NumPy arrays (a subclass with ``.data.ptr``), RawModule kernels launch on
    the CPU emulator (built from exactly the kernel files the module's code concatenates),
    events read the wall clock. Only NVRTC compilation is not covered here
    (tests/kernels/test_nvrtc.py compiles the same modules with the real NVRTC)."""
    import time
    import types

    from refengine.kernels.build import (KERNEL_SOURCES, SELF_TEST_SOURCES, build_emulation_library,
                                         cuda_source_dir, emulated_launch, nvrtc_program)
    from refengine.kernels.plans import Launch

    class ndarray(np.ndarray):
        @property
        def data(self):
            return types.SimpleNamespace(ptr=np.asarray(self).ctypes.data)

    class RawModule:
        def __init__(self, code, options=()):
            for sources in (KERNEL_SOURCES, SELF_TEST_SOURCES):
                if (code, tuple(options)) == nvrtc_program(None, sources):
                    break
            else:
                raise AssertionError("RawModule got a program nvrtc_program does not make")
            self.lib = build_emulation_library([cuda_source_dir() / name for name in sources])

        def compile(self):  # the emulation library is built in __init__
            pass

        def get_function(self, name):
            def launch(grid, block, args, shared_mem=0):
                plain = tuple(np.asarray(a) if isinstance(a, np.ndarray) else a for a in args)
                emulated_launch(self.lib, Launch(name, tuple(grid), tuple(block), shared_mem, plain))
            return launch

    class Event:
        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

    cp = types.ModuleType("cupy")
    cp.__version__ = "stand-in"
    cp.ndarray = ndarray
    cp.asarray = lambda x, dtype=None: np.array(x, dtype=dtype).view(ndarray)
    cp.empty = lambda shape, dtype=np.float32: np.full(shape, np.nan, np.float32).astype(dtype).view(ndarray)
    cp.ascontiguousarray = lambda x: np.ascontiguousarray(x).view(ndarray)
    cp.asnumpy = lambda x: np.array(np.asarray(x))
    cp.float16, cp.float32 = np.float16, np.float32
    cp.random = types.SimpleNamespace(
        standard_normal=lambda shape, dtype=np.float32: np.random.default_rng(0).standard_normal(shape).astype(
            dtype).view(ndarray))
    cp.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    cp.RawModule = RawModule
    cp.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1,
                                      getDeviceProperties=lambda i: {"name": b"stand-in", "multiProcessorCount": 1,
                                                                       "totalGlobalMem": 1 << 30},
                                      runtimeGetVersion=lambda: 13000),
        Device=lambda: types.SimpleNamespace(id=0), get_cuda_path=lambda: None, Event=Event,
        get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3)
    return cp


def load_gpu_check():
    """benchmarks/gpu_check.py as a module (benchmarks/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check


# --- scheduler unit tests ------------------------------------------------------------------

def stub_step(sched):
    """One scheduler step with a stub model: ``postprocess`` gets token 7 for each sequence
    whose chunk reached its end, as the engine hands it sampled tokens."""
    out = sched.schedule()
    sampled = [(s, 7, None) for s, n in out.scheduled if s.num_computed_tokens + n == len(s)]
    sched.postprocess(out.scheduled, sampled)
    return out


class FakeSeq:
    """The sequence fields the sampler reads."""

    def __init__(self, params=None, prompt=(), output=(), uniforms=None, seed=0):
        from refengine.sampler import TokenUniforms
        from refengine.sampling_params import SamplingParams

        self.sampling_params = params or SamplingParams()
        self.prompt_token_ids = list(prompt)
        self.output_token_ids = list(output)
        self.uniforms = uniforms if uniforms is not None else TokenUniforms(seed)


def plan(out) -> list[tuple[str, int]]:
    """``(request_id, num_new_tokens)`` of a ``SchedulerOutput``, for readable asserts."""
    return [(s.request_id, n) for s, n in out.scheduled]


def assert_logits_match(ours: np.ndarray, ref, ids: list[int]) -> None:
    """Our prompt logits against transformers' (float32, eager) for the same ids."""
    import torch

    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].numpy()
    assert_logits_close(ours, want)


def assert_logits_close(ours: np.ndarray, want: np.ndarray) -> None:
    """Our prompt logits against transformers' ``want`` for the same ids, computed already
    (``[len(ids), vocab]`` float32): within 1e-4 relative and 1e-4 of the largest logit,
    and the same argmax in every row.

    ``np.isclose`` is the test ``assert_allclose`` applies (NaNs equal), without its
    separate passes over the NaN and infinity positions; ``assert_allclose`` itself runs
    only to report a mismatch, so a prompt's ``[len(ids), 262144]`` Gemma 3 logits are
    checked in one pass."""
    atol = 1e-4 * np.abs(want).max()
    if ours.shape != want.shape or not np.isclose(ours, want, rtol=1e-4, atol=atol, equal_nan=True).all():
        np.testing.assert_allclose(ours, want, rtol=1e-4, atol=atol)
    np.testing.assert_array_equal(ours.argmax(-1), want.argmax(-1))


def hf_greedy(model, ids, n):
    """``n`` greedy tokens of a transformers model after ``ids``, one full forward each."""
    import torch

    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def save_tiny_llama(path: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random-weight LlamaForCausalLM saved by transformers into ``path`` (vocab 211,
    3 layers, 4/2 heads, head_dim 32, tied embeddings; ``overrides`` change LlamaConfig fields)."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    fields = dict(vocab_size=211, hidden_size=128, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    tf.LlamaForCausalLM(tf.LlamaConfig(**{**fields, **overrides})).save_pretrained(path, safe_serialization=True)
    return path


def random_adapter(path: Path, model_dir: Path, r: int = 8, seed: int = 0) -> Path:
    """A PEFT LoRA adapter for the model in ``model_dir`` on q/v/down of every layer, random
    ``A`` and ``B`` (both non-zero, ``alpha = 2 r``), written as peft saves one."""
    import json

    from safetensors.numpy import save_file

    from refengine.models.hf_config import read_model_config

    cfg = read_model_config(model_dir)
    rng = np.random.default_rng(seed)
    q, kv, h, inter = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
        cfg.hidden_size, cfg.intermediate_size
    shapes = {"self_attn.q_proj": (q, h), "self_attn.v_proj": (kv, h), "mlp.down_proj": (h, inter)}
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        for module, (n_out, n_in) in shapes.items():
            prefix = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((r, n_in)) / np.sqrt(n_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (0.3 * rng.standard_normal((n_out, r))).astype(np.float32)
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj", "v_proj", "down_proj"],
        "bias": "none", "use_rslora": False}))
    return path


# --- engines that share one loaded model ---------------------------------------------------

#: EngineConfig fields that only the scheduler, the block manager, the KV pool, speculative
#: decoding or the logs read: engines that differ only in these can run the same model object
#: (``scheduler_config`` holds ``max_model_len`` too, which the model's RoPE tables read: it
#: is in the key on its own).
SCHEDULE_ONLY_FIELDS = frozenset({
    "block_size", "num_kv_blocks", "bytes_per_block", "enable_prefix_caching", "gpu_memory_utilization",
    "max_logprobs", "log_stats", "trace", "scheduler_config", "speculative_config", "draft_model_config",
    "draft_bytes_per_block"})


@contextlib.contextmanager
def shared_models(max_models: int = 2):
    """Engines built inside the block share their model, and skip the kernel warm-up.

    An engine's model (weights, attention backend, layer ops) is a function of the engine
    options outside :data:`SCHEDULE_ONLY_FIELDS` (and ``max_model_len``), and no step
    changes it (the KV cache, the decode capture and every per-request state belong to the
    engine). So two engines whose options differ only in the schedule (block size, pool
    size, token budget, chunked prefill, prefix caching, speculative decoding) compute the
    same bits with one model object as with two: ``refengine.core.engine.build_model`` is
    replaced by a cache of the ``max_models`` models used last (each SmolLM2 copy holds
    about 0.5 GB), and a model taken from it is prepared for its new engine as a new one is
    (:meth:`refengine.ops.LayerOps.prepare_model`: the process-wide thread pools).

    The kernel warm-up (:func:`refengine.cpu.engine_hooks.warm_up`: forward passes at engine
    start that make numba compile or load its kernel variants before the first request,
    about 12 CPU seconds on SmolLM2) is skipped: each variant then compiles or loads at its
    first use, and the outputs are the same bits either way.

    Shared only among engines that leave ``num_threads`` unset (the pools are the process's,
    set when a model is prepared), keep ``activation_dtype="auto"`` (Q8_0 activations
    interleave the weights as the model is prepared) and run in this process; any other
    engine builds a model of its own.
    """
    import dataclasses

    import pytest

    import refengine.core.engine as engine_module

    real_build = engine_module.build_model
    built: dict[tuple, object] = {}  # key -> model, the least recently used first
    no_warm_up: set[type] = set()  # layer-ops classes whose warm_up is patched out

    def build(config, dequantize_gguf, partition=None, **kwargs):
        if config.num_threads is not None or config.activation_dtype != "auto" or partition is not None:
            model = real_build(config, dequantize_gguf, partition, **kwargs)  # a model of its own
        else:
            key = (config.max_model_len, dequantize_gguf, tuple(
                (f.name, repr(getattr(config, f.name))) for f in dataclasses.fields(config)
                if f.name not in SCHEDULE_ONLY_FIELDS))
            model = built.pop(key, None)
            if model is None:
                if len(built) >= max_models:
                    built.pop(next(iter(built)))
                model = real_build(config, dequantize_gguf, **kwargs)
            else:
                model.ops.prepare_model(model, config)
            built[key] = model
        if type(model.ops) not in no_warm_up:  # the engine calls ops.warm_up right after
            no_warm_up.add(type(model.ops))
            patch.setattr(type(model.ops), "warm_up", lambda self, *args, **kwargs: None)
        return model

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "build_model", build)
        yield


# --- servers over loopback HTTP ------------------------------------------------------------

TIMEOUT = 60.0  # seconds, any one HTTP call
KEY = "sk-test-key"


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1:<ephemeral> in a thread; a context manager."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
        assert not self.thread.is_alive(), "the server did not stop"


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.005):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not reached in time")


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def client(url: str, key: str = KEY):
    """An ``openai`` client of the server at ``url`` (no retries, :data:`TIMEOUT`)."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=TIMEOUT)


@contextlib.contextmanager
def http_server(engine, served_model_name: str, timeout: float = TIMEOUT):
    """``engine`` served as ``served_model_name`` (:class:`ServerThread`); yields an
    ``httpx.Client`` on it. Skips the test without the server's packages."""
    import pytest

    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from refengine.server.api import create_app

    app = create_app(engine, served_model_name=served_model_name)
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=timeout) as h:
        yield h
