"""refengine.formats.gguf_file's own GGUF header reader (read_gguf_header), against gguf-py's GGUFReader.

The oracle is ``gguf.GGUFReader`` (what the engine used before): on the two real files
(SmolLM2 Q4_1, Gemma 3 Q4_K_M; skipped when absent) and on synthetic files written by
``gguf.GGUFWriter`` with every value type, arrays of arrays, several tensor types, a custom
alignment and big-endian byte order, the reader must give the same keys, value types and
values, the same tensor names, types, dimensions, offsets, numpy shapes, dtypes and bytes.
Hand-built files (``_gguf``) check the errors: truncation anywhere in the header, a bad
magic, unsupported versions, unknown value and tensor types, bad UTF-8, data past the end.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType, GGUFValueType  # noqa: E402

from refengine.formats.gguf_file import GGUFFile, read_gguf_header, read_metadata  # noqa: E402

# --- comparison with gguf.GGUFReader --------------------------------------------------------


def _flat(value):
    """GGUFReader's ``contents()`` flattens arrays of arrays into one list of leaves."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list) and value and not isinstance(value[0], str):
        return [leaf for item in value for leaf in _flat(item)]
    return value


def assert_same_as_gguf_reader(path, theirs=None):
    """``theirs``: ``gguf.GGUFReader(path)``, built here unless given."""
    ours = read_gguf_header(path)
    theirs = gguf.GGUFReader(path) if theirs is None else theirs
    assert ours.version == theirs.fields["GGUF.version"].contents()
    assert ours.byte_order == ("<" if theirs.endianess == gguf.GGUFEndian.LITTLE else ">")
    assert ours.alignment == theirs.alignment and ours.data_offset == theirs.data_offset

    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # GGUF.*: the header counts
    assert list(ours.fields) == keys
    assert len(keys) == theirs.fields["GGUF.kv_count"].contents()
    for key in keys:
        mine, field = ours.fields[key], theirs.fields[key]
        assert mine.key == key
        assert mine.types == tuple(field.types), key
        assert _flat(mine.value) == field.contents(), key
        if isinstance(mine.value, np.ndarray):  # numbers: one array of the item type
            assert mine.value.dtype == np.dtype(theirs.gguf_scalar_to_np[mine.types[-1]]), key
        elif isinstance(mine.value, list):
            assert field.types[-1] == GGUFValueType.STRING or field.types[1] == GGUFValueType.ARRAY, key
        else:
            assert type(mine.value) is type(field.contents()), key

    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    assert len(ours.tensors) == theirs.fields["GGUF.tensor_count"].contents()
    for mine, t in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == t.tensor_type, t.name
        assert mine.shape == tuple(int(d) for d in t.shape), t.name
        assert (mine.n_elements, mine.n_bytes, mine.data_offset) == (t.n_elements, t.n_bytes, t.data_offset), t.name
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape, t.name
        assert mine.data.nbytes == t.n_bytes, t.name
        as_bytes = [np.asarray(d).reshape(-1).view(np.uint8) for d in (mine.data, t.data)]
        assert np.array_equal(*as_bytes), t.name
        # a zero-copy, read-only view of the file
        assert not mine.data.flags.owndata and not mine.data.flags.writeable, t.name
    return ours, theirs


def test_smollm2_file_reads_as_gguf_reader(gguf_path):
    ours, _ = assert_same_as_gguf_reader(gguf_path)
    assert len(ours.fields["tokenizer.ggml.tokens"].value) == 49152
    assert {t.tensor_type.name for t in ours.tensors} >= {"Q4_1", "F32"}


def test_gemma3_file_reads_as_gguf_reader(gemma3_gguf, shared_gguf_reader):
    """Against the session's reader of the file (``conftest.py``), the one transformers'
    Gemma 3 references are loaded with: the worker of the ``gemma3`` group builds it once."""
    ours, _ = assert_same_as_gguf_reader(gemma3_gguf, shared_gguf_reader(gemma3_gguf))
    tokens = ours.fields["tokenizer.ggml.tokens"]
    assert len(tokens.value) == 262144 and tokens.types == (GGUFValueType.ARRAY, GGUFValueType.STRING)
    scores = ours.fields["tokenizer.ggml.scores"].value
    assert isinstance(scores, np.ndarray) and scores.dtype == np.float32 and scores.shape == (262144,)


# --- synthetic files ------------------------------------------------------------------------

SCALARS = [  # (writer method, key, value, type)
    ("add_uint8", "t.uint8", 250, GGUFValueType.UINT8),
    ("add_int8", "t.int8", -120, GGUFValueType.INT8),
    ("add_uint16", "t.uint16", 65000, GGUFValueType.UINT16),
    ("add_int16", "t.int16", -32000, GGUFValueType.INT16),
    ("add_uint32", "t.uint32", 4_000_000_000, GGUFValueType.UINT32),
    ("add_int32", "t.int32", -2_000_000_000, GGUFValueType.INT32),
    ("add_float32", "t.float32", 1e-5, GGUFValueType.FLOAT32),
    ("add_uint64", "t.uint64", 2**64 - 1, GGUFValueType.UINT64),
    ("add_int64", "t.int64", -(2**63), GGUFValueType.INT64),
    ("add_float64", "t.float64", 1e-300, GGUFValueType.FLOAT64),
    ("add_bool", "t.bool_true", True, GGUFValueType.BOOL),
    ("add_bool", "t.bool_false", False, GGUFValueType.BOOL),
    ("add_string", "t.string", "héllo ▁wörld 🙂\n\x00end", GGUFValueType.STRING),
]
ARRAYS = [  # (key, value, item type)
    ("a.uint8", [0, 1, 255], GGUFValueType.UINT8),
    ("a.int8", [-128, 0, 127], GGUFValueType.INT8),
    ("a.uint16", [0, 65535], GGUFValueType.UINT16),
    ("a.int16", [-32768, 32767], GGUFValueType.INT16),
    ("a.uint32", [0, 2**32 - 1], GGUFValueType.UINT32),
    ("a.int32", [-(2**31), 7, 2**31 - 1], GGUFValueType.INT32),
    ("a.float32", [0.5, -1e-5, 3.25e10], GGUFValueType.FLOAT32),
    ("a.uint64", [0, 2**64 - 1], GGUFValueType.UINT64),
    ("a.int64", [-(2**63), 2**63 - 1], GGUFValueType.INT64),
    ("a.float64", [1e-300, -2.5], GGUFValueType.FLOAT64),
    ("a.bool", [True, False, True, True], GGUFValueType.BOOL),
    ("a.string", ["<s>", "", "▁the", "日本語", "a b"], GGUFValueType.STRING),
]
NESTED = [  # arrays of arrays (GGUFWriter picks the inner item type from the Python values)
    ("n.ints", [[1, 2], [3, 4, 5], [6]], GGUFValueType.INT32),
    ("n.strings", [["a", "bc"], ["▁d"]], GGUFValueType.STRING),
]


def _tensors(rng):
    """name -> (array to write, raw_dtype or None): numbers and blocks of several types."""
    q8 = gguf.quants.quantize(rng.standard_normal((3, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    return {
        "f32": (rng.standard_normal((3, 5)).astype(np.float32), None),
        "f16.3d": (rng.standard_normal((2, 3, 4)).astype(np.float16), None),
        "vector": (rng.standard_normal(7).astype(np.float32), None),
        "i8": (rng.integers(-128, 128, (2, 9)).astype(np.int8), None),
        "i32": (rng.integers(-(2**31), 2**31, (4,)).astype(np.int32), None),
        "f64": (rng.standard_normal((2, 2)), None),
        "q8_0": (q8, GGMLQuantizationType.Q8_0),
        "q4_k": (rng.integers(0, 256, (2, 2 * 144)).astype(np.uint8), GGMLQuantizationType.Q4_K),
        "bf16": (rng.integers(0, 256, (3, 2 * 16)).astype(np.uint8), GGMLQuantizationType.BF16),
    }


def _write(path, alignment=None, big_endian=False):
    writer = gguf.GGUFWriter(str(path), "llama",
                             endianess=gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE)
    if alignment:
        writer.add_custom_alignment(alignment)
    for method, key, value, _ in SCALARS:
        getattr(writer, method)(key, value)
    for key, value, item_type in ARRAYS:
        writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=item_type)
    for key, value, _ in NESTED:
        writer.add_key_value(key, value, GGUFValueType.ARRAY)
    tensors = _tensors(np.random.default_rng(0))
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_shape=array.shape if raw_dtype else None, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


@pytest.mark.parametrize("alignment,big_endian", [(None, False), (64, False), (None, True)],
                         ids=["default", "align64", "big-endian"])
def test_synthetic_file_reads_as_gguf_reader(tmp_path, alignment, big_endian):
    path = tmp_path / "all.gguf"
    tensors = _write(path, alignment, big_endian)
    ours, _ = assert_same_as_gguf_reader(path)
    assert ours.alignment == (alignment or 32) and ours.data_offset % ours.alignment == 0
    assert ours.byte_order == (">" if big_endian else "<")

    # and against what was written, not only against the oracle
    fields = ours.fields
    for _, key, value, vtype in SCALARS:
        assert fields[key].types == (vtype,)
        assert fields[key].value == (float(np.float32(value)) if vtype == GGUFValueType.FLOAT32 else value)
        assert type(fields[key].value) is type(value)
    for key, value, item_type in ARRAYS:
        assert fields[key].types == (GGUFValueType.ARRAY, item_type)
        got = fields[key].value
        if item_type == GGUFValueType.STRING:
            assert got == value
        else:
            assert isinstance(got, np.ndarray) and got.dtype.isnative
            want = np.asarray(value, dtype=got.dtype)
            assert np.array_equal(got, want), key
    for key, value, leaf in NESTED:
        assert fields[key].types == (GGUFValueType.ARRAY, GGUFValueType.ARRAY, leaf)
        assert [list(v) if isinstance(v, list) else v.tolist() for v in fields[key].value] == value

    for t in ours.tensors:
        array, raw_dtype = tensors[t.name]
        assert t.tensor_type == (raw_dtype or GGMLQuantizationType[{"float32": "F32", "float16": "F16",
                                 "float64": "F64", "int8": "I8", "int32": "I32"}[array.dtype.name]])
        assert t.data.shape == array.shape
        assert np.array_equal(t.data.astype(array.dtype), array), t.name  # astype: big-endian files


def test_read_metadata_gives_plain_copies(tmp_path):
    path = tmp_path / "all.gguf"
    _write(path)
    header = read_gguf_header(path)
    meta = read_metadata(header)
    assert list(meta) == list(header.fields)
    assert meta["a.int32"] == [-(2**31), 7, 2**31 - 1] and type(meta["a.int32"][0]) is int
    assert meta["a.bool"] == [True, False, True, True] and type(meta["a.bool"][0]) is bool
    assert meta["n.ints"] == [[1, 2], [3, 4, 5], [6]]
    meta["a.string"].append("edited")
    meta["a.int32"][0] = 0
    assert header.fields["a.string"].value == ["<s>", "", "▁the", "日本語", "a b"]
    assert header.fields["a.int32"].value[0] == -(2**31)


def test_gguf_file_reads_its_header_with_read_gguf_header(gguf_path):
    f = GGUFFile(gguf_path)
    assert f.reader.path == gguf_path and f.meta == read_metadata(f.reader)
    assert f.tensor_types()["blk.0.attn_q.weight"] == "Q4_1"


# --- bad files --------------------------------------------------------------------------------


def _str(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def _gguf(kvs: list[bytes] = (), tensors: list[bytes] = (), version: int = 3, data: bytes = b"",
          magic: bytes = b"GGUF") -> bytes:
    """A GGUF file built by hand: ``kvs`` and ``tensors`` are encoded entries; data after padding to 32."""
    head = _head(kvs, tensors, version, magic)
    return head + b"\0" * (-len(head) % 32) + data


def _head(kvs=(), tensors=(), version=3, magic=b"GGUF") -> bytes:
    return magic + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + payload


def _tensor(name: str, dims: tuple[int, ...], ggml_type: int, offset: int = 0) -> bytes:
    return _str(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)


GOOD_ENTRIES = (
    [_kv("general.architecture", 8, _str("llama")),
     _kv("x.ints", 9, struct.pack("<IQ3i", 5, 3, 1, 2, 3)),
     _kv("x.strings", 9, struct.pack("<IQ", 8, 2) + _str("ab") + _str("▁c")),
     _kv("x.nested", 9, struct.pack("<IQ", 9, 2) + struct.pack("<IQ2H", 2, 2, 7, 8) + struct.pack("<IQ", 2, 0))],
    [_tensor("w", (4, 2), 0)],  # F32 [2, 4]
)
GOOD = _gguf(*GOOD_ENTRIES, data=np.arange(8, dtype="<f4").tobytes())


def _read(tmp_path, raw: bytes, name="bad.gguf"):
    path = tmp_path / name
    path.write_bytes(raw)
    return read_gguf_header(path)


def test_hand_built_file_reads(tmp_path):
    header = _read(tmp_path, GOOD, "good.gguf")
    assert header.fields["x.ints"].value.tolist() == [1, 2, 3]
    assert header.fields["x.strings"].value == ["ab", "▁c"]
    nested = header.fields["x.nested"]
    assert nested.types == (GGUFValueType.ARRAY, GGUFValueType.ARRAY, GGUFValueType.UINT16)
    assert [v.tolist() for v in nested.value] == [[7, 8], []] and nested.value[1].dtype == np.uint16
    (w,) = header.tensors
    assert w.shape == (4, 2) and w.data.shape == (2, 4)
    assert np.array_equal(w.data, np.arange(8, dtype=np.float32).reshape(2, 4))


def test_every_truncation_of_the_header_is_named(tmp_path):
    for cut in range(len(_head(*GOOD_ENTRIES))):  # every cut inside the header, from 0 bytes
        with pytest.raises(ValueError, match=r"bad\.gguf.*truncated header"):
            _read(tmp_path, GOOD[:cut])


def test_data_outside_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"bad\.gguf.*tensor 'w'.*outside the file"):
        _read(tmp_path, GOOD[:-1])
    far = _gguf([], [_tensor("w", (4, 2), 0, offset=2**40)], data=b"\0" * 32)
    with pytest.raises(ValueError, match=r"bad\.gguf.*tensor 'w'.*outside the file"):
        _read(tmp_path, far)


def test_bad_magic(tmp_path):
    with pytest.raises(ValueError, match=r"bad\.gguf.*bad magic b'GGML'"):
        _read(tmp_path, b"GGML" + GOOD[4:])
    with pytest.raises(ValueError, match="bad magic"):
        _read(tmp_path, b"definitely not a gguf file" * 10)


@pytest.mark.parametrize("version", [0, 1, 4, 0x01020304])
def test_unsupported_version(tmp_path, version):
    with pytest.raises(ValueError, match=rf"bad\.gguf.*unsupported GGUF version {version} "):
        _read(tmp_path, GOOD[:4] + struct.pack("<I", version) + GOOD[8:])


def test_version_2_reads(tmp_path):
    assert _read(tmp_path, GOOD[:4] + struct.pack("<I", 2) + GOOD[8:]).version == 2


def test_unknown_types(tmp_path):
    with pytest.raises(ValueError, match=r"bad\.gguf.*'x' has unknown value type 13"):
        _read(tmp_path, _gguf([_kv("x", 13, b"\0" * 8)]))
    with pytest.raises(ValueError, match=r"bad\.gguf.*'x' has unknown array item type 99"):
        _read(tmp_path, _gguf([_kv("x", 9, struct.pack("<IQ", 99, 1))]))
    with pytest.raises(ValueError, match=r"bad\.gguf.*tensor 'w' has unknown ggml type 200"):
        _read(tmp_path, _gguf([], [_tensor("w", (4,), 200)], data=b"\0" * 64))


def test_other_malformed_headers(tmp_path):
    with pytest.raises(ValueError, match=r"bad\.gguf.*not UTF-8"):
        _read(tmp_path, _gguf([_kv("x", 8, _str(b"\xff\xfe"))]))
    with pytest.raises(ValueError, match=r"bad\.gguf.*string 1 of 'x'.*not UTF-8"):
        _read(tmp_path, _gguf([_kv("x", 9, struct.pack("<IQ", 8, 2) + _str("ok") + _str(b"\xc3"))]))
    with pytest.raises(ValueError, match=r"bad\.gguf.*duplicate key 'x'"):
        _read(tmp_path, _gguf([_kv("x", 4, b"\1\0\0\0")] * 2))
    with pytest.raises(ValueError, match=r"bad\.gguf.*duplicate tensor name 'w'"):
        _read(tmp_path, _gguf([], [_tensor("w", (4,), 0)] * 2, data=b"\0" * 32))
    with pytest.raises(ValueError, match=r"bad\.gguf.*general\.alignment must be a uint32 power of two"):
        _read(tmp_path, _gguf([_kv("general.alignment", 4, struct.pack("<I", 48))]))
    with pytest.raises(ValueError, match=r"bad\.gguf.*general\.alignment"):
        _read(tmp_path, _gguf([_kv("general.alignment", 10, struct.pack("<Q", 64))]))
    with pytest.raises(ValueError, match=r"bad\.gguf.*tensor 'w'.*Q8_0 block size 32"):
        _read(tmp_path, _gguf([], [_tensor("w", (16, 2), int(GGMLQuantizationType.Q8_0))], data=b"\0" * 64))
    deep = struct.pack("<IQ", 9, 1) * 100_000 + struct.pack("<IQ", 4, 0)
    with pytest.raises(ValueError, match=r"bad\.gguf.*'x'(\[0\])* nests arrays too deeply \(more than 4 levels\)"):
        _read(tmp_path, _gguf([_kv("x", 9, deep)]))
    with pytest.raises(ValueError, match=r"empty\.gguf.*truncated header"):
        _read(tmp_path, b"", "empty.gguf")


def test_counts_are_checked_against_the_file_before_reading(tmp_path):
    """A count is refused when its items cannot fit in the rest of the file (each takes at
    least a few bytes), before anything is allocated for them."""
    huge = struct.pack("<Q", 2**40)
    with pytest.raises(ValueError, match=r"truncated header: the key/value count 1099511627776 \(items of at least "
                                         r"13 bytes each\) at byte 24"):
        _read(tmp_path, GOOD[:16] + huge + GOOD[24:])
    with pytest.raises(ValueError, match=r"truncated header: the tensor count 1099511627776 \(items of at least 24"):
        _read(tmp_path, GOOD[:8] + huge + GOOD[16:])
    with pytest.raises(ValueError, match=r"truncated header: the length of 'x' 1099511627776 \(items of at least 8"):
        _read(tmp_path, _gguf([_kv("x", 9, struct.pack("<IQ", 8, 2**40))]))
    with pytest.raises(ValueError, match=r"truncated header: the length of 'x' 1099511627776 \(items of at least 12"):
        _read(tmp_path, _gguf([_kv("x", 9, struct.pack("<IQ", 9, 2**40))]))
    with pytest.raises(ValueError, match=r"tensor 'w' has 5 dimensions; ggml tensors have at most 4"):
        _read(tmp_path, _gguf([], [_tensor("w", (1, 1, 1, 1, 1), 0)], data=b"\0" * 32))


def test_gguf_file_names_a_bad_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(GOOD[:40])
    with pytest.raises(ValueError, match=r"model\.gguf.*is not a readable GGUF file: truncated header"):
        GGUFFile(path)
