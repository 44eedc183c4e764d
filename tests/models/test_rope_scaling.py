"""RoPE scaling types ``dynamic``, ``yarn`` and ``longrope`` against transformers.

For each type a transformers config is built, its ``config.to_dict()`` goes through
refengine's parser (:func:`refengine.models.hf_config.model_config_from_dict`) into a
:class:`refengine.ops.layers.RotaryEmbedding`, and the result is compared with
``ROPE_INIT_FUNCTIONS`` (inverse frequencies, attention factor) and with the model's rotary
module (``LlamaRotaryEmbedding`` / ``Phi3RotaryEmbedding``) run over one forward of
``max_model_len`` positions, which is the static length the engine fixes (see
:func:`refengine.ops.layers.rope_frequencies`). Then the bad configs, each a clear ValueError.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from refengine.models.hf_config import model_config_from_dict  # noqa: E402
from refengine.ops.layers import RotaryEmbedding, rope_frequencies  # noqa: E402
from refengine.ops.numpy_ops import NumpyOps  # noqa: E402

HEADS, HEAD_DIM = 4, 16
SIZES = dict(vocab_size=64, hidden_size=HEADS * HEAD_DIM, intermediate_size=32, num_hidden_layers=1,
             num_attention_heads=HEADS, num_key_value_heads=HEADS)


def llama_config(max_positions: int, rope_parameters: dict, **extra):
    return tf.LlamaConfig(**{**SIZES, **extra}, head_dim=HEAD_DIM, max_position_embeddings=max_positions,
                          rope_parameters=dict(rope_parameters))


def phi3_config(max_positions: int, original: int, rope_parameters: dict):
    return tf.Phi3Config(**SIZES, max_position_embeddings=max_positions, original_max_position_embeddings=original,
                         rope_parameters=dict(rope_parameters))


def refengine_rope(hf_config, max_model_len: int) -> RotaryEmbedding:
    """transformers' config as a ``config.json`` through refengine's parser, as a table of
    ``max(max_model_len, max_position_embeddings)`` rows fixed for ``max_model_len``."""
    d = hf_config.to_dict()
    d["architectures"] = ["LlamaForCausalLM"]  # the parser's generic path: no family's extras
    mc = model_config_from_dict(d)
    rows = max(max_model_len, mc.max_position_embeddings)
    return RotaryEmbedding(mc.head_dim, rows, mc.rope_theta, mc.rope_scaling, max_model_len=max_model_len)


def hf_tables(module_cls, hf_config, length: int):
    """cos, sin ``[length, head_dim // 2]`` of the rotary module after one forward over
    positions ``0 .. length - 1`` (what ``dynamic_rope_update`` sees for such a sequence)."""
    module = module_cls(hf_config)
    x = torch.zeros(1, length, HEAD_DIM)
    with torch.no_grad():
        cos, sin = module(x, torch.arange(length)[None])
    half = HEAD_DIM // 2
    return cos[0, :, :half].numpy(), sin[0, :, :half].numpy(), module


def assert_matches_module(rope: RotaryEmbedding, module_cls, hf_config, length: int):
    cos, sin, module = hf_tables(module_cls, hf_config, length)
    np.testing.assert_allclose(rope.cos[:length], cos, rtol=0, atol=1e-6)
    np.testing.assert_allclose(rope.sin[:length], sin, rtol=0, atol=1e-6)
    assert rope.attention_factor == pytest.approx(module.attention_scaling, rel=1e-12)
    # the rotation itself, attention factor included, against transformers' apply_rotary_pos_emb
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rng = np.random.default_rng(0)
    q = rng.standard_normal((length, 2, HEAD_DIM)).astype(np.float32)
    full_cos, full_sin = (np.concatenate([t, t], axis=-1) for t in (cos, sin))
    want, _ = apply_rotary_pos_emb(torch.from_numpy(q).transpose(0, 1)[None], torch.zeros(1, 1, length, HEAD_DIM),
                                   torch.from_numpy(full_cos)[None], torch.from_numpy(full_sin)[None])
    got, _ = NumpyOps().rope(q, q, np.arange(length), rope)
    np.testing.assert_allclose(got, want[0].transpose(0, 1).numpy(), rtol=0, atol=2e-5)


def assert_inv_freq(rope: RotaryEmbedding, want: torch.Tensor, exact: bool = True):
    want = want.numpy()
    assert rope.inv_freq.dtype == np.float32 and rope.inv_freq.shape == want.shape
    if exact:
        np.testing.assert_array_equal(rope.inv_freq, want)
    else:  # float32 rounding of the same formula in another order
        np.testing.assert_allclose(rope.inv_freq, want, rtol=4 * 2.0 ** -24, atol=0)


# --- dynamic NTK --------------------------------------------------------------------------

@pytest.mark.parametrize("factor", [2.0, 3.3, 4])
def test_dynamic_past_the_original_context(factor):
    max_positions, max_model_len = 128, 320
    config = llama_config(max_positions, {"rope_type": "dynamic", "factor": factor, "rope_theta": 10000.0})
    rope = refengine_rope(config, max_model_len)
    assert rope.cos.shape == (max_model_len, HEAD_DIM // 2)
    # the forward's path (seq_len a tensor, as dynamic_rope_update passes it): the same float32 operations
    want, scale = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=torch.tensor(max_model_len))
    assert_inv_freq(rope, want)
    assert rope.attention_factor == scale == 1.0
    # with a Python int the base is computed in float64: equal up to float32 rounding
    want_int, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=max_model_len)
    assert_inv_freq(rope, want_int, exact=False)
    assert not np.array_equal(rope.inv_freq, RotaryEmbedding(HEAD_DIM, 10, 10000.0, None).inv_freq)  # it grew
    assert_matches_module(rope, tf.models.llama.modeling_llama.LlamaRotaryEmbedding, config, max_model_len)


def test_dynamic_within_the_original_context_is_plain_rope():
    config = llama_config(256, {"rope_type": "dynamic", "factor": 3.3, "rope_theta": 10000.0})
    for max_model_len in (100, 256):
        rope = refengine_rope(config, max_model_len)
        want, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=max_model_len)
        assert_inv_freq(rope, want)
        np.testing.assert_array_equal(rope.inv_freq, RotaryEmbedding(HEAD_DIM, 10, 10000.0, None).inv_freq)
        assert_matches_module(rope, tf.models.llama.modeling_llama.LlamaRotaryEmbedding, config, max_model_len)


# --- YaRN -----------------------------------------------------------------------------------

YARN_CASES = {
    "defaults": {"factor": 4.0, "original_max_position_embeddings": 64},
    "betas-untruncated": {"factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2,
                          "truncate": False},
    "mscale-ratio": {"factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.707},
    "mscale-one-only": {"factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707},
    "attention-factor": {"factor": 2.0, "original_max_position_embeddings": 128, "attention_factor": 0.8},
    "factor-from-lengths": {"factor": None, "original_max_position_embeddings": 64},
    "theta-1e6": {"factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e6},
}


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn(case):
    params = {"rope_type": "yarn", "rope_theta": 10000.0, **YARN_CASES[case]}
    config = llama_config(256, params)
    rope = refengine_rope(config, 256)
    want, scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    assert_inv_freq(rope, want)
    assert rope.attention_factor == pytest.approx(scale, rel=1e-12)
    assert rope.attention_factor != 1.0
    assert_matches_module(rope, tf.models.llama.modeling_llama.LlamaRotaryEmbedding, config, 256)


def test_yarn_attention_factor_formulas():
    base = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    assert rope_frequencies(HEAD_DIM, 1e4, base)[1] == pytest.approx(0.1 * math.log(4.0) + 1)
    ratio = rope_frequencies(HEAD_DIM, 1e4, dict(base, mscale=1.0, mscale_all_dim=0.5))[1]
    assert ratio == pytest.approx((0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1))
    assert rope_frequencies(HEAD_DIM, 1e4, dict(base, attention_factor=0.5))[1] == 0.5
    assert rope_frequencies(HEAD_DIM, 1e4, dict(base, factor=1.0))[1] == 1.0


def test_yarn_original_max_position_embeddings_defaults():
    """Without it in the dict: the config's top-level value if any (it wins, as in
    transformers), else max_position_embeddings."""
    d = llama_config(256, {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}).to_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    d["rope_parameters"].pop("original_max_position_embeddings", None)
    assert model_config_from_dict(dict(d)).rope_scaling["original_max_position_embeddings"] == 256
    d["rope_parameters"]["original_max_position_embeddings"] = 100
    d["original_max_position_embeddings"] = 64
    assert model_config_from_dict(d).rope_scaling["original_max_position_embeddings"] == 64


# --- longrope (Phi-3) -----------------------------------------------------------------------

def longrope_params(**extra):
    rng = np.random.default_rng(3)
    short = [float(v) for v in 1 + 0.2 * rng.random(HEAD_DIM // 2)]
    long = [float(v) for v in np.sort(1 + 7 * rng.random(HEAD_DIM // 2))]
    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short, "long_factor": long, **extra}


@pytest.mark.parametrize("max_model_len, factors", [(512, "long"), (129, "long"), (128, "short"), (100, "short")])
def test_longrope_picks_the_factors_by_max_model_len(max_model_len, factors):
    config = phi3_config(512, 128, longrope_params())
    rope = refengine_rope(config, max_model_len)
    # transformers: long factors once the sequence passes the original context
    seq_len = 128 + 1 if factors == "long" else None
    want, scale = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
    assert_inv_freq(rope, want)
    assert scale == pytest.approx(math.sqrt(1 + math.log(512 / 128) / math.log(128)))
    assert rope.attention_factor == pytest.approx(scale, rel=1e-12)
    assert_matches_module(rope, tf.models.phi3.modeling_phi3.Phi3RotaryEmbedding, config, max_model_len)


@pytest.mark.parametrize("extra", [{"factor": 8.0}, {"attention_factor": 1.1}, {"factor": 1.0}])
def test_longrope_explicit_factor_and_attention_factor(extra):
    config = phi3_config(512, 128, longrope_params(**extra))
    rope = refengine_rope(config, 512)
    want, scale = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=512)
    assert_inv_freq(rope, want)
    assert rope.attention_factor == pytest.approx(scale, rel=1e-12)
    assert_matches_module(rope, tf.models.phi3.modeling_phi3.Phi3RotaryEmbedding, config, 512)


def test_longrope_top_level_original_max_position_embeddings():
    """Phi-3 keeps ``original_max_position_embeddings`` at the top level: it goes into the
    dict, over the dict's own, and ``factor`` is filled in from the lengths."""
    d = phi3_config(512, 128, longrope_params()).to_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    d["rope_parameters"]["original_max_position_embeddings"] = 999
    scaling = model_config_from_dict(d).rope_scaling
    assert scaling["original_max_position_embeddings"] == 128 and scaling["factor"] == 4.0
    assert scaling["rope_type"] == "longrope"


# --- RotaryEmbedding's max_model_len --------------------------------------------------------

def test_max_model_len_defaults_to_the_table_size():
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": 64, "factor": 4.0,
               **{k: longrope_params()[k] for k in ("short_factor", "long_factor")}}
    assert RotaryEmbedding(HEAD_DIM, 256, 1e4, scaling).max_model_len == 256
    long = RotaryEmbedding(HEAD_DIM, 256, 1e4, scaling).inv_freq
    short = RotaryEmbedding(HEAD_DIM, 256, 1e4, scaling, max_model_len=64).inv_freq
    np.testing.assert_array_equal(long, rope_frequencies(HEAD_DIM, 1e4, scaling, max_model_len=65)[0])
    np.testing.assert_array_equal(short, rope_frequencies(HEAD_DIM, 1e4, scaling)[0])
    assert not np.array_equal(long, short)


@pytest.mark.parametrize("bad", [0, 257, 2.5, True])
def test_max_model_len_outside_the_table(bad):
    with pytest.raises(ValueError, match=rf"max_model_len must be an integer in \[1, max_positions=256\].*{bad!r}"):
        RotaryEmbedding(HEAD_DIM, 256, 1e4, None, max_model_len=bad)


def test_rope_frequencies_missing_key_and_unknown_type():
    with pytest.raises(ValueError, match=r"rope scaling type 'yarn' needs 'original_max_position_embeddings'"):
        rope_frequencies(HEAD_DIM, 1e4, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match=r"unsupported rope scaling type 'su'"):
        rope_frequencies(HEAD_DIM, 1e4, {"rope_type": "su"})


# --- bad configs ------------------------------------------------------------------------------

def config_json(rope_scaling: dict, **top) -> dict:
    d = dict(SIZES, architectures=["LlamaForCausalLM"], head_dim=HEAD_DIM, max_position_embeddings=256,
             rope_theta=10000.0, rope_scaling=rope_scaling)
    d.update(top)
    return d


LONG = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

BAD = [
    ({"rope_type": "dynamic"}, {}, r"rope_scaling: required key 'factor' is missing"),
    ({"rope_type": "dynamic", "factor": -2}, {}, r"rope_scaling: 'factor' must be a finite number > 0, got -2"),
    (dict(YARN, factor=0), {}, r"rope_scaling: 'factor' must be a finite number > 0, got 0"),
    (dict(YARN, original_max_position_embeddings=0), {},
     r"rope_scaling: 'original_max_position_embeddings' must be an integer >= 1, got 0"),
    (dict(YARN, original_max_position_embeddings=64.5), {},
     r"rope_scaling: 'original_max_position_embeddings' must be an integer >= 1, got 64.5"),
    (dict(YARN, beta_fast=1, beta_slow=32), {}, r"rope_scaling: 'beta_fast' \(1\) must be >= 'beta_slow' \(32\)"),
    (dict(YARN, beta_fast=-1), {}, r"rope_scaling: 'beta_fast' must be a finite number > 0, got -1"),
    (dict(YARN, attention_factor=0), {}, r"rope_scaling: 'attention_factor' must be a finite number > 0, got 0"),
    (dict(YARN, mscale=float("nan")), {}, r"rope_scaling: 'mscale' must be a finite number >= 0, got nan"),
    (dict(YARN, mscale_all_dim="1"), {}, r"rope_scaling: 'mscale_all_dim' must be a finite number >= 0, got '1'"),
    (dict(YARN, truncate="yes"), {}, r"rope_scaling: 'truncate' must be true or false, got 'yes'"),
    ({k: v for k, v in LONG.items() if k != "long_factor"}, {},
     r"rope_scaling: required key 'long_factor' is missing \(a list of head_dim // 2 = 8 numbers > 0\)"),
    (dict(LONG, short_factor=[1.0] * 7), {},
     r"rope_scaling: 'short_factor' must be a list of head_dim // 2 = 8 finite numbers > 0, got a list of 7"),
    (dict(LONG, long_factor=[2.0] * 7 + [0.0]), {},
     r"rope_scaling: 'long_factor' must be a list of head_dim // 2 = 8 finite numbers > 0, got \[2.0, "),
    (dict(LONG, long_factor="2.0"), {}, r"rope_scaling: 'long_factor' must be a list of .* got '2.0'"),
    (dict(LONG, attention_factor=-1.0), {}, r"rope_scaling: 'attention_factor' must be a finite number > 0"),
    (LONG, {"original_max_position_embeddings": 0}, r"'original_max_position_embeddings' must be an integer >= 1"),
    (dict(LONG, partial_rotary_factor=0.75), {},
     r"rope_scaling: 'partial_rotary_factor' 0.75 is not supported: refengine rotates the whole head"),
    (YARN, {"partial_rotary_factor": 0.5}, r"'partial_rotary_factor' 0.5 is not supported"),
    (None, {"partial_rotary_factor": 0.5}, r"'partial_rotary_factor' 0.5 is not supported"),
    ({"rope_type": "su", "factor": 2.0}, {}, r"unsupported rope scaling type 'su'; supported: default, linear, "
                                             r"dynamic, yarn, longrope, llama3"),
]


@pytest.mark.parametrize("rope_scaling, top, message", BAD, ids=[m[:40] for _, _, m in BAD])
def test_bad_rope_scaling(rope_scaling, top, message):
    with pytest.raises(ValueError, match=r"^my/config.json: .*" + message):
        model_config_from_dict(config_json(rope_scaling, **top), source="my/config.json")


def test_good_optional_fields_are_accepted():
    ok = [dict(YARN, truncate=None, mscale=0, beta_fast=32, beta_slow=32), dict(LONG, partial_rotary_factor=1.0),
          {"rope_type": "dynamic", "factor": 2, "original_max_position_embeddings": 5}]
    for rope_scaling in ok:
        mc = model_config_from_dict(config_json(rope_scaling, partial_rotary_factor=1))
        RotaryEmbedding(mc.head_dim, mc.max_position_embeddings, mc.rope_theta, mc.rope_scaling)
    # dynamic grows beyond max_position_embeddings, whatever the dict says
    assert mc.rope_scaling["original_max_position_embeddings"] == 256


# --- through the engine -----------------------------------------------------------------------

@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.8},
    # original 16 < the prompt, so transformers too rotates with the long factors
    longrope_params(original_max_position_embeddings=16),
], ids=["yarn", "longrope"])
def test_tiny_llama_matches_transformers(rope_parameters, tmp_path):
    """Prompt logits and a greedy continuation of a tiny random Llama: the attention factor
    reaches q and k (the scores scale by its square) on the engine's numpy path."""
    from tests.helpers import assert_logits_match, hf_greedy

    from refengine import LLM, SamplingParams

    torch.manual_seed(0)
    config = llama_config(512, dict(rope_parameters, rope_theta=10000.0), vocab_size=211, bos_token_id=1,
                          eos_token_id=2)
    config._attn_implementation = "eager"
    ref = tf.LlamaForCausalLM(config).eval()
    ref.save_pretrained(tmp_path, safe_serialization=True)
    ids = np.random.default_rng(1).integers(3, 211, size=37).tolist()
    llm = LLM(model=tmp_path, device="cpu", block_size=8, attention_backend="numpy", log_stats=False)
    assert llm.llm_engine.model.rope.attention_factor != 1.0
    assert_logits_match(llm.prompt_logits(ids), ref, ids)
    out = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(ref, ids, 6)
