"""A GGUF model file cannot exhaust the machine: every hostile header is refused with a
ValueError naming the key and the limit, in well under a second and 100 MB (issue "No
request, file or neighbour can take the engine").

Two parts. Crafted files, one per defect found by review (a layer count of 2^31, merges
rebuilt in quadratic time, nested arrays, unaligned or overlapping tensors, special token
ids outside the vocabulary, a context of 2^26 positions ...), each loaded by the engine as
``LLM(model="x.gguf")`` would, timed with ``time.perf_counter`` and its Python/NumPy peak
measured with ``tracemalloc``; one through the CLI, which prints it as one ``Error:`` line.
Then a fuzz corpus: a small valid Gemma 3 and Llama file (``tests/formats/tiny_gguf.py``,
written by ``gguf.GGUFWriter``) with every kind of header field mutated (counts, lengths,
types, offsets, scalar values), bytes flipped, cuts, random bytes, and ``GGUFWriter`` files
with keys of the wrong type or out of range: each must load or raise ValueError, within the
same bounds.
"""

from __future__ import annotations

import re
import struct
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf import GGUFValueType as T  # noqa: E402

from refengine.core.engine import LLMEngine  # noqa: E402
from refengine.formats.gguf_file import close_gguf_files  # noqa: E402
from tests.formats.tiny_gguf import (DELETE, GEMMA_TOKENS, GEMMA_TYPES, LAYERS, gemma3_meta, llama_meta,  # noqa: E402
                                     tensors, tiny_gguf, write_gguf)

SECONDS, PEAK_BYTES = 1.0, 100 * 2**20


def load(path: Path):
    """The engine on ``path`` as ``LLM(model=path)`` builds it (config, tokenizer, weights,
    model, KV pool), on the NumPy backend with a pool of 32 tokens."""
    try:
        return LLMEngine(path, attention_backend="numpy", num_kv_blocks=8, block_size=4, log_stats=False)
    finally:
        close_gguf_files()


def bounded(fn, *args):
    """``fn(*args)``'s result or exception, asserting it took under :data:`SECONDS` and
    :data:`PEAK_BYTES` (Python and NumPy allocations, ``tracemalloc``)."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        result = fn(*args)
    except Exception as e:  # noqa: BLE001  (returned for the caller to judge)
        result = e
    finally:
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert elapsed < SECONDS, f"took {elapsed:.2f} s"
    assert peak < PEAK_BYTES, f"peaked at {peak / 2**20:.0f} MiB"
    return result


def assert_refused(path: Path, message: str):
    error = bounded(load, path)
    assert isinstance(error, ValueError), repr(error)
    assert re.search(message, str(error)), str(error)
    assert str(error).startswith(str(path)) or repr(str(path)) in str(error), str(error)  # the file is named


# --- hand-edited headers --------------------------------------------------------------------

def _header_fields(raw: bytes) -> list[tuple[int, str, str]]:
    """``(byte offset, struct code, kind)`` of every fixed-size field of a little-endian
    header: the version and counts, each key's value type, string and array lengths, array
    item types, scalar values, and each tensor's dimension count, dimensions, type and offset."""
    out, pos = [], 4
    sizes = {"B": 1, "b": 1, "H": 2, "h": 2, "I": 4, "i": 4, "f": 4, "?": 1, "Q": 8, "q": 8, "d": 8}
    codes = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def take(code: str, kind: str) -> int:
        nonlocal pos
        out.append((pos, code, kind))
        (value,) = struct.unpack_from("<" + code, raw, pos)
        pos += sizes[code]
        return value

    def string(kind: str) -> None:
        nonlocal pos
        n = take("Q", kind)  # (not `pos += take(...)`, which would read pos before take moves it)
        pos += n

    def value(vtype: int) -> None:
        if vtype in codes:
            take(codes[vtype], "value")
        elif vtype == 8:
            string("string length")
        else:
            item = take("I", "array item type")
            for _ in range(take("Q", "array length")):
                value(item)

    take("I", "version")
    n_tensors, n_kv = take("Q", "tensor count"), take("Q", "key/value count")
    for _ in range(n_kv):
        string("key length")
        value(take("I", "value type"))
    for _ in range(n_tensors):
        string("tensor name length")
        for _ in range(take("I", "dimension count")):
            take("Q", "dimension")
        take("I", "tensor type")
        take("Q", "tensor offset")
    return out


def _set(raw: bytes, pos: int, code: str, value) -> bytes:
    return raw[:pos] + struct.pack("<" + code, value) + raw[pos + struct.calcsize(code):]


def _tensor_offset_field(raw: bytes, name: str) -> int:
    """Where tensor ``name``'s data offset is written in the header."""
    fields = _header_fields(raw)
    start = raw.index(struct.pack("<Q", len(name)) + name.encode())
    return next(pos for pos, _, kind in fields if kind == "tensor offset" and pos > start)


# --- the crafted files ----------------------------------------------------------------------

def test_the_tiny_files_load(tmp_path):
    """The base of every case below is sound: what fails, fails for its edit alone."""
    for arch in ("gemma3", "llama"):
        engine = bounded(load, tiny_gguf(tmp_path / f"{arch}.gguf", arch))
        assert not isinstance(engine, Exception), repr(engine)
        assert engine.model_config.num_hidden_layers == LAYERS
        assert engine.tokenizer.decode(engine.tokenizer.encode("ab a")) == "ab a"


@pytest.mark.parametrize("arch, changes, message", [
    # 1. layer counts: capped, and checked against the tensors before anything per layer is built
    ("gemma3", {"gemma3.block_count": 2**31}, r"'gemma3.block_count' must be an integer in \[1, 512\], got 2147483648"),
    ("llama", {"llama.block_count": 512}, r"'llama.block_count' is 512, but the file has no tensors for layer 2"),
    ("llama", {"llama.block_count": 0}, r"'llama.block_count' must be an integer in \[1, 512\], got 0"),
    # 4. counts that divided or indexed
    ("llama", {"llama.attention.head_count": 0}, r"'llama.attention.head_count' must be an integer >= 1, got 0"),
    ("gemma3", {"gemma3.attention.head_count_kv": 0}, r"'gemma3.attention.head_count_kv' must be an integer >= 1"),
    ("llama", {"llama.embedding_length": "8"}, r"'llama.embedding_length' must be an integer >= 1, got '8'"),
    ("gemma3", {"gemma3.attention.head_count": ([2, 2], T.UINT32)}, r"'gemma3.attention.head_count' must be an "
                                                                      r"integer >= 1, got \[2, 2\]"),
    ("gemma3", {"gemma3.context_length": DELETE}, r"GGUF metadata lacks 'gemma3.context_length'"),
    ("gemma3", {"gemma3.rope.freq_base": float("nan")}, r"'gemma3.rope.freq_base' must be a finite number > 0"),
    ("gemma3", {"gemma3.attention.sliding_window_pattern": ([True], T.BOOL)},
     r"sliding_window_pattern has 1 entries for 2 layers"),
    # 4. special token ids: outside the vocabulary, or negative (which silently picked the last token)
    ("gemma3", {"tokenizer.ggml.bos_token_id": 15}, r"'tokenizer.ggml.bos_token_id' must be an integer in \[0, 14\], "
                                                    r"got 15"),
    ("gemma3", {"tokenizer.ggml.bos_token_id": (-1, T.INT32)}, r"'tokenizer.ggml.bos_token_id' must be an integer "
                                                               r"in \[0, 14\], got -1"),
    ("llama", {"tokenizer.ggml.eos_token_id": 2**32 - 1}, r"'tokenizer.ggml.eos_token_id' must be an integer in "
                                                          r"\[0, 8\], got 4294967295"),
    ("gemma3", {"tokenizer.ggml.unknown_token_id": 99}, r"'tokenizer.ggml.unknown_token_id' must be an integer"),
    ("llama", {"tokenizer.ggml.padding_token_id": (-5, T.INT32)}, r"'tokenizer.ggml.padding_token_id' must be"),
    ("llama", {"tokenizer.ggml.eot_token_id": 9}, r"'tokenizer.ggml.eot_token_id' must be an integer in \[0, 8\]"),
    # 4. the vocabulary and merges
    ("llama", {"tokenizer.ggml.merges": ["a b", "Ġa", "Ġa b"]},
     r"'tokenizer.ggml.merges'\[1\] = 'Ġa' is not two tokens of the vocabulary separated by a space"),
    ("llama", {"tokenizer.ggml.merges": ["a b", "a zz"]}, r"'tokenizer.ggml.merges'\[1\] = 'a zz' is not two tokens"),
    ("llama", {"tokenizer.ggml.merges": DELETE}, r"lacks 'tokenizer.ggml.merges' \(a 'gpt2' tokenizer needs"),
    ("llama", {"tokenizer.ggml.tokens": DELETE}, r"lacks 'tokenizer.ggml.tokens'"),
    ("llama", {"tokenizer.ggml.tokens": ([1, 2, 3], T.INT32)}, r"'tokenizer.ggml.tokens' must be a non-empty array "
                                                               r"of strings"),
    ("gemma3", {"tokenizer.ggml.token_type": [1, 1]}, r"'tokenizer.ggml.token_type' must be an array of 15 integers"),
    ("gemma3", {"tokenizer.ggml.token_type": ([1.0] * 15, T.FLOAT32)}, r"'tokenizer.ggml.token_type' must be an "
                                                                        r"array of 15 integers"),
    ("llama", {"tokenizer.ggml.pre": (["smollm"], T.STRING)}, r"unsupported GGUF pre-tokenizer \['smollm'\]"),
])
def test_hostile_metadata_is_refused(tmp_path, arch, changes, message):
    assert_refused(tiny_gguf(tmp_path / "bad.gguf", arch, **{k.replace(".", "__"): v for k, v in changes.items()}),
                   message)


def _gemma_vocab(path: Path, tokens: list[str]) -> Path:
    """The tiny Gemma 3 with ``tokens`` appended to its vocabulary (no merges stored), and an
    embedding of as many rows."""
    meta = gemma3_meta()
    meta["tokenizer.ggml.tokens"] = GEMMA_TOKENS + tokens
    meta["tokenizer.ggml.token_type"] = GEMMA_TYPES + [1] * len(tokens)
    meta["tokenizer.ggml.scores"] = [0.0] * (len(GEMMA_TOKENS) + len(tokens))
    return write_gguf(path, meta, tensors("gemma3", vocab=len(GEMMA_TOKENS) + len(tokens)))


def test_merges_rebuilt_within_bounds(tmp_path):
    """2. Gemma's merges are rebuilt from the vocabulary: every cut of a token into two tokens.
    ``"x" * k`` for k up to 900 (a 413 KB file) made 405,000 merges holding n^3/6 characters
    (616 MiB); one token of 100,000 characters took 1.2 s. Tokens of more than 256 characters,
    and more than 4 merges per token, are refused before that."""
    assert_refused(_gemma_vocab(tmp_path / "cubic.gguf", ["x" * k for k in range(1, 901)]),
                   r"gives more than 4 per token \(\d+ by token \d+ of 915; Gemma 3 has 1.96\)")
    assert_refused(_gemma_vocab(tmp_path / "one.gguf", ["y" * 100_000]),
                   r"'tokenizer.ggml.tokens'\[15\] has 100000 characters; rebuilding the merges .* at most 256")
    # "z" * k has k - 1 cuts into two tokens: 1 + 2 + ... merges for 15 + 40 tokens
    assert_refused(_gemma_vocab(tmp_path / "many.gguf", ["z" * k for k in range(1, 41)]),
                   r"gives more than 4 per token \(\d+ by token \d+ of 55; Gemma 3 has 1.96\)")
    engine = bounded(load, _gemma_vocab(tmp_path / "fine.gguf", ["z" * k for k in range(1, 9)]))
    assert engine.tokenizer.encode("z" * 11) == [18, 21]  # "z" * 4 + "z" * 7
    # within the bounds, the merges are transformers' (SentencePieceExtractor): every cut, best token first
    from refengine.formats.gguf_file import _rebuild_merges

    tokens = GEMMA_TOKENS + ["z" * k for k in range(1, 9)]
    vocab = set(tokens)
    assert _rebuild_merges(tokens) == [(t[:cut], t[cut:]) for t in tokens for cut in range(len(t) - 1, 0, -1)
                                       if t[:cut] in vocab and t[cut:] in vocab]


def _with_nested(raw_path: Path, payload: bytes, path: Path) -> Path:
    """The tiny Gemma 3 with one more key, ``x.nested``, whose array value is ``payload``."""
    raw = raw_path.read_bytes()
    key = struct.pack("<Q", 8) + b"x.nested" + struct.pack("<I", 9) + payload
    n_kv = struct.unpack_from("<Q", raw, 16)[0]
    # inserted after the last key/value; the tensor infos and data move, their offsets (relative to the
    # aligned data section) stay valid once the padding is redone
    fields = _header_fields(raw)
    first_tensor = next(pos for pos, _, kind in fields if kind == "tensor name length")
    infos_end = max(pos for pos, _, kind in fields if kind == "tensor offset") + 8
    data_start = -(-infos_end // 32) * 32
    head = raw[:16] + struct.pack("<Q", n_kv + 1) + raw[24:first_tensor] + key + raw[first_tensor:infos_end]
    path.write_bytes(head + b"\0" * (-len(head) % 32) + raw[data_start:])
    return path


def test_nested_arrays_are_bounded(tmp_path):
    """3. An array of 300,000 empty arrays is 3.6 MB of file and took some 35 times that in
    memory (an array object, a types tuple, a list entry for each); arrays of arrays are
    bounded to 65,536 inner arrays per file and 4 levels."""
    base = tiny_gguf(tmp_path / "base.gguf")
    n = 300_000
    many = struct.pack("<IQ", 9, n) + struct.pack("<IQ", 0, 0) * n
    assert_refused(_with_nested(base, many, tmp_path / "many.gguf"),
                   r"'x.nested' makes 300000 arrays inside arrays in the file; at most 65536 are read")
    deep = struct.pack("<IQ", 9, 1) * 8 + struct.pack("<IQ", 0, 0)
    assert_refused(_with_nested(base, deep, tmp_path / "deep.gguf"), r"nests arrays too deeply \(more than 4 levels\)")
    ok = struct.pack("<IQ", 9, 2) + struct.pack("<IQ", 5, 1) + struct.pack("<i", 7) + struct.pack("<IQ", 5, 0)
    engine = bounded(load, _with_nested(base, ok, tmp_path / "ok.gguf"))
    assert not isinstance(engine, Exception), repr(engine)


def test_tensor_offsets_are_aligned_disjoint_and_inside(tmp_path):
    """3. Tensor data must start at a multiple of ``general.alignment`` (32 by default), lie
    in the file and not overlap another tensor's (the GGUF spec; llama.cpp requires them
    packed in order)."""
    raw = tiny_gguf(tmp_path / "base.gguf", "llama").read_bytes()
    field = _tensor_offset_field(raw, "blk.1.ffn_down.weight")
    offset = struct.unpack_from("<Q", raw, field)[0]
    cases = [
        (offset + 4, r"the offset \d+ of tensor 'blk.1.ffn_down.weight' is not a multiple of the alignment 32"),
        (0, r"the data of tensors 'token_embd.weight' and 'blk.1.ffn_down.weight' overlap"),
        (2**64 - 32, r"the data of tensor 'blk.1.ffn_down.weight' .* lies outside the file"),
    ]
    for i, (value, message) in enumerate(cases):
        path = tmp_path / f"offset{i}.gguf"
        path.write_bytes(_set(raw, field, "Q", value))
        assert_refused(path, message)


def test_a_huge_context_costs_only_max_model_len(tmp_path):
    """5. The RoPE tables are sized by the engine's max_model_len (32 here: the pool), not by
    the file's context: 2^26 positions were two 2 GiB tables (Gemma 3 has two RoPEs)."""
    engine = bounded(load, tiny_gguf(tmp_path / "long.gguf", gemma3__context_length=2**26))
    assert not isinstance(engine, Exception), repr(engine)
    assert engine.model_config.max_position_embeddings == 2**26 and engine.config.max_model_len == 32
    layers = engine.model.layers
    assert {layer.rope.cos.shape for layer in layers} == {(32, 2)} and len({id(la.rope) for la in layers}) == 1
    assert engine.model.rope.cos.shape == (32, 2)
    engine.add_request("r", [2, 9, 10, 11] * 7, None)  # 28 prompt positions, then decode to the end
    while engine.has_unfinished_requests():
        engine.step()


def test_the_cli_prints_one_error_line(tmp_path):
    from click.testing import CliRunner

    from refengine.cli import main

    path = tiny_gguf(tmp_path / "bad.gguf", gemma3__block_count=2**31)
    t0 = time.perf_counter()
    res = CliRunner().invoke(main, ["generate", "--model", str(path), "--attention-backend", "numpy", "hi"])
    assert time.perf_counter() - t0 < SECONDS
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert res.stderr.splitlines() == [f"Error: {path}: GGUF metadata 'gemma3.block_count' must be an integer in "
                                       f"[1, 512], got 2147483648"]


# --- the fuzz corpus ---------------------------------------------------------------------------

def _values(code: str, old, rng) -> list:
    """Values to write over a field of struct ``code`` holding ``old``."""
    if code in "fd":
        return [float("nan"), float("inf"), -1.0, 0.0, 1e30, old * 2]
    if code == "?":
        return [2, 255]
    bits = 8 * struct.calcsize(code)
    top = 2 ** (bits - 1) - 1 if code.islower() else 2**bits - 1
    low = -(2 ** (bits - 1)) if code.islower() else 0
    picks = [0, 1, 2, 3, 7, 9, 13, 32, 2**16, 2**31, top, top - 1, old - 1, old + 1, 2 * old,
             int(rng.integers(0, 2**31))]
    return [v for v in picks if low <= v <= top]


def _corpus(tmp_path: Path) -> list[tuple[str, bytes]]:
    """(case id, file bytes): mutations of the two tiny files, and ``GGUFWriter`` files
    with keys of other types and values."""
    rng = np.random.default_rng(1234)
    cases = []
    for arch in ("gemma3", "llama"):
        raw = tiny_gguf(tmp_path / f"{arch}-base.gguf", arch).read_bytes()
        fields = _header_fields(raw)
        header_end = fields[-1][0] + 8
        for i in rng.choice(len(fields), 50, replace=False):
            pos, code, kind = fields[i]
            old = struct.unpack_from("<" + code, raw, pos)[0]
            values = _values(code, old, rng)
            value = values[rng.integers(len(values))]
            cases.append((f"{arch} {kind}@{pos}={value}", _set(raw, pos, code, value)))
        for k in range(20):  # bytes flipped in the header
            flipped = bytearray(raw)
            for pos in rng.integers(4, header_end, rng.integers(1, 4)):
                flipped[pos] = int(rng.integers(256))
            cases.append((f"{arch} flips {k}", bytes(flipped)))
        for cut in rng.integers(0, header_end, 5):
            cases.append((f"{arch} cut@{cut}", raw[:cut]))
        cases.append((f"{arch} random", raw[:24] + rng.bytes(len(raw) - 24)))
    # the oracle writer with a key of the wrong type or out of range
    values = [(0, T.UINT32), (-1, T.INT32), (2**32 - 1, T.UINT32), (2**63, T.UINT64), (1.5, T.FLOAT32),
              (float("nan"), T.FLOAT32), ("x", T.STRING), ([1, 2], T.INT32), (["a"], T.STRING), (True, T.BOOL)]
    for arch, meta in (("gemma3", gemma3_meta()), ("llama", llama_meta())):
        keys = sorted(meta)
        for j in range(10):
            key = keys[rng.integers(len(keys))]
            value = values[rng.integers(len(values))]
            path = write_gguf(tmp_path / f"w{arch}{j}.gguf", dict(meta, **{key: value}), tensors(arch))
            cases.append((f"{arch} writer {key}={value[0]!r}", path.read_bytes()))
    return cases


def test_fuzzed_headers_load_or_raise_value_error(tmp_path):
    outcomes = {"loaded": 0, "refused": 0}
    for i, (case, raw) in enumerate(_corpus(tmp_path)):
        path = tmp_path / f"fuzz{i}.gguf"  # a new name each: the engine shares open files by path
        path.write_bytes(raw)
        try:
            result = bounded(load, path)
        except AssertionError as e:
            raise AssertionError(f"{case}: {e}") from None
        if isinstance(result, Exception):
            assert isinstance(result, ValueError), f"{case}: {result!r}"
            outcomes["refused"] += 1
        else:
            outcomes["loaded"] += 1
    assert outcomes["loaded"] >= 15 and outcomes["refused"] >= 100, outcomes  # both paths exercised
