"""AWQ and GPTQ checkpoints (refengine/quant/awq_gptq.py) and their 4-bit form
(refengine/quant/int4.py, kernels in refengine/cpu/int_products.py).

A tiny random Llama is built with transformers; each linear layer's weights are first
rounded onto a 4-bit group grid (so packing them is lossless), then packed by the small
reference packers below, written from the formats' sources (AutoAWQ
``WQLinear_GEMM.from_linear``; AutoGPTQ ``QuantLinear.pack``, with GPTQ v1's ``zeros -= 1``;
GPTQModel's v2 without it; act-order ``g_idx`` as GPTQ's ``fasterquant`` makes it from a
permutation) and saved as safetensors with a ``quantization_config`` in config.json.
refengine's logits must equal transformers' float model of the rounded weights.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from tests.helpers import assert_logits_match, hf_greedy

from refengine import LLM, SamplingParams
from refengine.quant import StackedWeight, concat_rows, reference_linear
from refengine.quant.int4 import Int4Weight

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ gemm.py, from_linear


# --- the reference packers (loops, as the sources write them) -----------------------------

def pack_awq_gemm(intweight_in_out: np.ndarray) -> np.ndarray:
    """AutoAWQ ``WQLinear_GEMM.from_linear``: ``[rows, cols]`` ints -> int32 ``[rows, cols / 8]``,
    packed along the columns (the output axis) in the order ``order_map``."""
    rows, cols = intweight_in_out.shape
    src = intweight_in_out.astype(np.uint32)
    packed = np.zeros((rows, cols // 8), dtype=np.uint32)
    for col in range(cols // 8):
        for i in range(8):
            packed[:, col] |= src[:, col * 8 + AWQ_ORDER_MAP[i]] << np.uint32(4 * i)
    return packed.view(np.int32)


def pack_gptq_rows(intweight_in_out: np.ndarray) -> np.ndarray:
    """AutoGPTQ ``QuantLinear.pack``, qweight: ``[in, out]`` ints -> int32 ``[in / 8, out]``,
    eight consecutive input rows per int32, the first in the low bits."""
    src = intweight_in_out.astype(np.uint32)
    packed = np.zeros((src.shape[0] // 8, src.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < packed.shape[0]:
        for j in range(i, i + 8):
            packed[row] |= src[j] << np.uint32(4 * (j - i))
        i += 8
        row += 1
    return packed.view(np.int32)


def pack_gptq_cols(zeros_g_out: np.ndarray) -> np.ndarray:
    """AutoGPTQ ``QuantLinear.pack``, qzeros: ``[G, out]`` ints -> int32 ``[G, out / 8]``, in order."""
    src = zeros_g_out.astype(np.uint32)
    packed = np.zeros((src.shape[0], src.shape[1] // 8), dtype=np.uint32)
    i = col = 0
    while col < packed.shape[1]:
        for j in range(i, i + 8):
            packed[:, col] |= src[:, j] << np.uint32(4 * (j - i))
        i += 8
        col += 1
    return packed.view(np.int32)


def round_to_grid(w: np.ndarray, g_idx: np.ndarray, n_groups: int, min_zero: int, rng):
    """``w [out, in]`` -> ``(q [out, in], z [out, G], s [out, G] float16, w_rounded float32)``
    with ``w_rounded = float32(q - z) * float32(s)`` (the formats' definition), asymmetric
    min/max per group; zero points in [min_zero, 15] (GPTQ v1 cannot store 0)."""
    out_features = w.shape[0]
    q = np.zeros(w.shape, np.int64)
    z = np.zeros((out_features, n_groups), np.int64)
    s = np.zeros((out_features, n_groups), np.float16)
    for g in range(n_groups):
        cols = np.flatnonzero(g_idx == g)
        lo, hi = np.minimum(w[:, cols].min(1), 0), np.maximum(w[:, cols].max(1), 0)
        scale = ((hi - lo) / 15 * rng.uniform(1.0, 1.3, out_features)).astype(np.float16)
        scale = np.maximum(scale, np.float16(1e-3))
        zero = np.clip(np.round(-lo / scale.astype(np.float32)), min_zero, 15).astype(np.int64)
        qq = np.clip(np.round(w[:, cols] / scale.astype(np.float32)[:, None]) + zero[:, None], 0, 15)
        q[:, cols], z[:, g], s[:, g] = qq, zero, scale
    w_rounded = (q - z[:, g_idx]).astype(np.float32) * s[:, g_idx].astype(np.float32)
    return q, z, s, w_rounded


CASES = {
    # name: (method, group_size, act_order, checkpoint format, tied embeddings)
    "awq-g32": ("awq", 32, False, "gemm", True),
    "awq-row": ("awq", -1, False, "gemm", False),
    "gptq-v1-g32": ("gptq", 32, False, "gptq", True),
    "gptq-v1-g32-act": ("gptq", 32, True, "gptq", False),
    "gptq-v2-g64-act": ("gptq", 64, True, "gptq_v2", True),  # in=96: a last group of 32 columns
    "gptq-v2-row": ("gptq", -1, False, "gptq_v2", True),
}


def build_quantized(path, method, group_size, act_order, fmt, tied, seed=0, g_idx_file=True):
    """Save a tiny quantized Llama in ``path``; return transformers' float model of it."""
    import transformers as tf

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    cfg = tf.LlamaConfig(vocab_size=211, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=tied)
    cfg._attn_implementation = "eager"
    model = tf.LlamaForCausalLM(cfg).eval()
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    tensors = {}
    for name, value in state.items():
        prefix = name[:-len(".weight")]
        if not any(prefix.endswith(lin) for lin in LINEARS):
            if name.endswith("norm.weight"):
                value = (1.0 + 0.2 * rng.standard_normal(value.shape)).astype(np.float32)
                state[name] = value
            tensors[name] = value
            continue
        w = value.astype(np.float32) * 4  # wider than the init, so the grid is coarse
        out_features, in_features = w.shape
        gs = in_features if group_size == -1 else group_size
        n_groups = -(-in_features // gs)
        if act_order:  # GPTQ: quantize in a permuted order; g_idx[i] = invperm[i] // gs
            perm = rng.permutation(in_features)
            g_idx = (np.argsort(perm) // gs).astype(np.int32)
        else:
            g_idx = (np.arange(in_features) // gs).astype(np.int32)
        q, z, s, w_rounded = round_to_grid(w, g_idx, n_groups, 1 if fmt == "gptq" else 0, rng)
        state[name] = w_rounded
        if method == "awq":
            tensors[prefix + ".qweight"] = pack_awq_gemm(q.T)
            tensors[prefix + ".qzeros"] = pack_awq_gemm(z.T)
        else:
            tensors[prefix + ".qweight"] = pack_gptq_rows(q.T)
            tensors[prefix + ".qzeros"] = pack_gptq_cols(z.T - (1 if fmt == "gptq" else 0))
            if g_idx_file or act_order:
                tensors[prefix + ".g_idx"] = g_idx
        tensors[prefix + ".scales"] = np.ascontiguousarray(s.T)  # float16 [G, out]
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    model.save_pretrained(path, safe_serialization=True)  # config.json (and a float checkpoint, replaced)
    if tied:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    if method == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": fmt}
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order, "sym": False,
              "checkpoint_format": fmt}
    config["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("case", list(CASES))
def test_quantized_checkpoint_matches_transformers(case, backend, tmp_path):
    if backend == "numba":
        pytest.importorskip("numba")
    method = CASES[case][0]
    ref = build_quantized(tmp_path, *CASES[case])
    llm = LLM(tmp_path, attention_backend=backend, block_size=8, log_stats=False)
    assert llm.llm_engine.config.quantization == method
    layer = llm.llm_engine.model.layers[0]
    assert all(isinstance(getattr(layer, n), (Int4Weight, StackedWeight)) for n in ("qkv", "o", "gate_up", "down"))
    ids = np.random.default_rng(1).integers(3, 211, size=70).tolist()  # 70 rows: the tile path of prefill
    assert_logits_match(llm.prompt_logits(ids), ref, ids)
    short = ids[:9]  # the dot kernels
    assert_logits_match(llm.prompt_logits(short), ref, short)
    out = llm.generate([short], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(ref, short, 10)


def test_gptq_without_g_idx_and_explicit_flag(tmp_path):
    ref = build_quantized(tmp_path, "gptq", 32, False, "gptq", True, g_idx_file=False)
    assert not any(k.endswith(".g_idx") for k in load_file(tmp_path / "model.safetensors"))
    ids = list(range(3, 30))
    assert_logits_match(LLM(tmp_path, quantization="gptq", log_stats=False).prompt_logits(ids), ref, ids)


def test_act_order_permutation_is_kept(tmp_path):
    build_quantized(tmp_path, "gptq", 32, True, "gptq", True)
    model = LLM(tmp_path, log_stats=False).llm_engine.model
    qkv = model.layers[0].qkv
    parts = qkv.parts if isinstance(qkv, StackedWeight) else [qkv]
    assert all(isinstance(p, Int4Weight) and p.perm is not None for p in parts)  # random perms: stacked


# --- strict loading and bad options ------------------------------------------------------

def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_flag_and_checkpoint_mismatch(tmp_path):
    build_quantized(tmp_path, "awq", 32, False, "gemm", True)
    with pytest.raises(ValueError, match="quantization='gptq' but .*config.json declares a 'awq' checkpoint"):
        LLM(tmp_path, quantization="gptq", log_stats=False)
    with pytest.raises(ValueError, match="quantization='int8' but .*declares a 'awq' checkpoint"):
        LLM(tmp_path, quantization="int8", log_stats=False)


@pytest.mark.parametrize("changes, message", [
    ({"bits": 8}, r"\['bits'\] = 8: only 4-bit AWQ"),
    ({"version": "gemv"}, "AWQ version/format 'gemv' is not supported"),
    ({"zero_point": False}, r"\['zero_point'\] = False"),
    ({"group_size": 0}, r"\['group_size'\] = 0 must be -1"),
    ({"quant_method": "bitsandbytes"}, r"\['quant_method'\] = 'bitsandbytes' is not supported"),
])
def test_unsupported_awq_configs(tmp_path, changes, message):
    build_quantized(tmp_path, "awq", 32, False, "gemm", True)
    _edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        LLM(tmp_path, log_stats=False)


def test_unsupported_gptq_configs(tmp_path):
    build_quantized(tmp_path, "gptq", 32, False, "gptq", True)
    _edit_config(tmp_path, checkpoint_format="marlin")
    with pytest.raises(ValueError, match="GPTQ checkpoint_format 'marlin' is not supported"):
        LLM(tmp_path, log_stats=False)
    _edit_config(tmp_path, checkpoint_format="gptq", pack_dtype="int64")
    with pytest.raises(ValueError, match=r"\['pack_dtype'\] = 'int64'"):
        LLM(tmp_path, log_stats=False)


def _edit_tensors(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_and_stray_packed_tensors(tmp_path):
    build_quantized(tmp_path, "gptq", 32, True, "gptq", True)
    name = "model.layers.1.mlp.down_proj"
    _edit_tensors(tmp_path, lambda t: t.pop(name + ".g_idx"))
    with pytest.raises(ValueError, match=f"has {name}.qweight but not {name}.g_idx"):
        LLM(tmp_path, log_stats=False)
    _edit_tensors(tmp_path, lambda t: t.pop(name + ".qzeros"))
    with pytest.raises(ValueError, match=f"has {name}.qweight but not {name}.qzeros"):
        LLM(tmp_path, log_stats=False)


def test_stray_and_inconsistent_tensors(tmp_path):
    build_quantized(tmp_path, "awq", 32, False, "gemm", True)
    _edit_tensors(tmp_path, lambda t: t.update({"model.layers.0.mlp.up_proj.g_idx": np.zeros(128, np.int32)}))
    with pytest.raises(ValueError, match=r"unused tensor\(s\), e.g. \['model.layers.0.mlp.up_proj.g_idx'\]"):
        LLM(tmp_path, log_stats=False)
    build_quantized(tmp_path, "awq", 32, False, "gemm", True)
    name = "model.layers.0.self_attn.o_proj"
    _edit_tensors(tmp_path, lambda t: t.update({name + ".scales": t[name + ".scales"][:2]}))
    with pytest.raises(ValueError, match=f"{name}: scales has shape \\(2, 128\\), expected \\(4, 128\\)"):
        LLM(tmp_path, log_stats=False)
    build_quantized(tmp_path, "awq", 32, False, "gemm", True)
    _edit_tensors(tmp_path, lambda t: t.update({name + ".weight": np.zeros((128, 128), np.float32)}))
    with pytest.raises(ValueError, match=f"has both {name}.weight and {name}.qweight"):
        LLM(tmp_path, log_stats=False)


def test_bad_g_idx(tmp_path):
    build_quantized(tmp_path, "gptq", 32, True, "gptq_v2", True)
    name = "model.layers.0.mlp.gate_proj"
    _edit_tensors(tmp_path, lambda t: t.update({name + ".g_idx": np.zeros(128, np.int32)}))
    with pytest.raises(ValueError, match="g_idx does not put 32 columns in each group"):
        LLM(tmp_path, log_stats=False)


def test_quantization_config_without_packed_tensors(tmp_path):
    build_quantized(tmp_path, "awq", 32, False, "gemm", True)
    import transformers as tf

    tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=211, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2)).save_pretrained(
        tmp_path / "float", safe_serialization=True)
    (tmp_path / "model.safetensors").write_bytes((tmp_path / "float" / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"says the checkpoint is AWQ-quantized, but .* has no '\*.qweight'"):
        LLM(tmp_path, log_stats=False)


@pytest.mark.parametrize("method, qweight_shape", [("awq", (0, 4)), ("gptq", (0, 32)), ("awq", (8, 0))])
def test_empty_qweight_is_named(method, qweight_shape):
    """An empty ``qweight`` with ``group_size`` -1 made groups of zero columns (a
    ZeroDivisionError); it is refused as a ValueError naming the layer and the tensor."""
    from refengine.quant.awq_gptq import CheckpointQuantization

    ckpt = CheckpointQuantization.from_config({"quant_method": method, "group_size": -1}, "config.json")
    weights = {"p.qweight": np.zeros(qweight_shape, np.int32), "p.qzeros": np.zeros((1, 4), np.int32),
               "p.scales": np.zeros((1, 32), np.float16)}
    shape = re.escape(str(qweight_shape))
    with pytest.raises(ValueError, match=rf"checkpoint in 'dir', p: qweight is empty \(shape {shape}\); a quantized "
                                         "matrix has at least one row and column"):
        ckpt.repack(weights, "dir")


# --- Int4Weight and its kernels ------------------------------------------------------------

ROWS = [1, 2, 3, 5, 8, 17, 64, 200]


@pytest.mark.parametrize("out_features, in_features, group_size, act_order", [
    (40, 96, 32, False), (40, 96, 32, True), (24, 128, 128, False), (17, 96, 64, True),  # partial last group
    (9, 80, 48, False),  # group % 32 != 0: the general kernel
    (33, 38, 38, True),  # fewer than 32 columns: tails only
])
def test_int4_kernel_matches_the_numpy_twin(out_features, in_features, group_size, act_order):
    pytest.importorskip("numba")
    rng = np.random.default_rng(5)
    n_groups = -(-in_features // group_size)
    q = rng.integers(0, 16, (out_features, in_features))
    z = rng.integers(0, 17, (out_features, n_groups))
    s = rng.uniform(0.01, 0.1, (out_features, n_groups)).astype(np.float32)
    perm = rng.permutation(in_features) if act_order else None
    w = Int4Weight.from_values(q, s, z, group_size, perm)
    stored = (q - z[:, np.arange(in_features) // group_size]).astype(np.float32) \
        * s[:, np.arange(in_features) // group_size]
    want_w = np.empty_like(stored)
    want_w[:, perm if perm is not None else np.arange(in_features)] = stored
    np.testing.assert_array_equal(w.dequantize(), want_w)  # the definition, input order
    np.testing.assert_array_equal(w.select_rows([3, 0, 3]), want_w[[3, 0, 3]])
    for rows in ROWS:
        x = rng.standard_normal((rows, in_features)).astype(np.float32)
        got, want = w.numba_linear(x), reference_linear(x, w)
        bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(want_w).T.astype(np.float64)) + 1e-30
        assert (np.abs(got - want) <= bound).all(), (rows, float((np.abs(got - want) / bound).max()))


def test_int4_dot_kernel_results_do_not_depend_on_the_batch():
    pytest.importorskip("numba")
    from refengine.cpu.int_products import INT4_BLAS_MIN_ROWS

    rng = np.random.default_rng(6)
    w = Int4Weight.from_values(rng.integers(0, 16, (30, 128)), rng.random((30, 4)), rng.integers(0, 16, (30, 4)), 32)
    x = rng.standard_normal((INT4_BLAS_MIN_ROWS - 1, 128)).astype(np.float32)
    batch = w.numba_linear(x)
    for t in (0, 1, x.shape[0] - 1):
        np.testing.assert_array_equal(w.numba_linear(x[t:t + 1]), batch[t:t + 1])


def test_int4_take_concat_and_checks():
    rng = np.random.default_rng(7)
    a = Int4Weight.from_values(rng.integers(0, 16, (6, 64)), rng.random((6, 2)), rng.integers(0, 16, (6, 2)), 32)
    b = Int4Weight.from_values(rng.integers(0, 16, (4, 64)), rng.random((4, 2)), rng.integers(0, 16, (4, 2)), 32)
    both = concat_rows([a, b])
    assert isinstance(both, Int4Weight) and both.shape == (10, 64)
    np.testing.assert_array_equal(both.dequantize(), np.concatenate([a.dequantize(), b.dequantize()]))
    np.testing.assert_array_equal(both.take_rows([9, 0]).dequantize(), both.dequantize()[[9, 0]])
    c = Int4Weight.from_values(rng.integers(0, 16, (4, 64)), rng.random((4, 2)), rng.integers(0, 16, (4, 2)), 32,
                               rng.permutation(64))
    assert isinstance(concat_rows([a, c]), StackedWeight)  # different permutations cannot share one matrix
    assert a.nbytes == 6 * 32 + 6 * 2 * 4 + 6 * 2
    with pytest.raises(ValueError, match="int4 values must lie in"):
        Int4Weight.from_values(np.full((2, 4), 16), np.ones((2, 1)), np.zeros((2, 1)), 4)
    with pytest.raises(ValueError, match="even number of input features"):
        Int4Weight.from_values(np.zeros((2, 5)), np.ones((2, 1)), np.zeros((2, 1)), 6)
    with pytest.raises(ValueError, match="group_size must be even"):
        Int4Weight.from_values(np.zeros((2, 6)), np.ones((2, 2)), np.zeros((2, 2)), 3)
    with pytest.raises(ValueError, match="perm must be a permutation"):
        Int4Weight.from_values(np.zeros((2, 6)), np.ones((2, 1)), np.zeros((2, 1)), 6, [0, 0, 1, 2, 3, 4])
