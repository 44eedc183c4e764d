"""refengine.tokenizer on the converted SmolLM2 tokenizer.

Two references, each used where it is right:

- ``transformers``' own GGUF tokenizer conversion (``AutoTokenizer.from_pretrained(dir,
  gguf_file=...)``) rebuilds a plain ByteLevel pre-tokenizer and misses SmolLM2's
  ``Digits(individual_digits=True)`` step, so it only agrees with the true tokenizer on
  text without digits. For digits we assert ids written out by hand.
- ``transformers`` loading *our* converted directory: the reference for chat templates.
"""

from __future__ import annotations

import jinja2
import pytest

from refengine.tokenizer import Tokenizer

NO_DIGIT_TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "你好，世界！今天天气很好。",
    "日本語のテキストと한국어",
    "family: 👨\u200d👩\u200d👧\u200d👦, flag: 🏳\ufe0f\u200d🌈, thumbs: 👍🏽",
    "def add(a, b):\n    return a + b\n\n\tif x != y: pass  # tab\r\n",
    "   leading spaces, trailing spaces   ",
    "multiple    inner     spaces and\n\n\nnewlines",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "don't won't it's I'm we've they'll she'd",
    "café naïve façade Ωmega ß",
    "",
]


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def hf_gguf_tok(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_converted_tok(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_dir)


# --- encode / decode ----------------------------------------------------------------------


@pytest.mark.parametrize("text", NO_DIGIT_TEXTS)
def test_matches_transformers_gguf_tokenizer_without_digits(tok, hf_gguf_tok, text):
    assert not any(c.isdigit() for c in text)
    expected = hf_gguf_tok(text, add_special_tokens=False)["input_ids"]
    assert tok.encode(text) == expected
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_known_ids(tok):
    assert tok.encode("Hello, world!") == [19556, 28, 905, 17]
    assert tok.convert_ids_to_tokens([19556, 28, 905, 17]) == ["Hello", ",", "Ġworld", "!"]
    # ZWJ (U+200D) is bytes e2 80 8d -> byte-level tokens 'âĢ' (321) + 'į' (231)
    family = "👨\u200d👩\u200d👧\u200d👦"
    assert tok.encode(family) == [10813, 235, 118, 321, 231, 10813, 235, 119, 321, 231,
                                  10813, 235, 117, 321, 231, 10813, 235, 116]
    assert tok.encode("你好") == [18645, 250, 48392, 138]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]


def test_digits_are_single_tokens(tok):
    # '0'..'9' are ids 32..41; SmolLM2 splits every digit before byte-level BPE.
    assert tok.encode("0123456789") == list(range(32, 42))
    assert tok.encode("2024") == [34, 32, 34, 36]
    assert tok.convert_ids_to_tokens(tok.encode("2024")) == ["2", "0", "2", "4"]
    assert tok.encode("Version 3.14 released in 2024") == [
        22348, 216, 35, 30, 33, 36, 5118, 281, 216, 34, 32, 34, 36
    ]
    assert tok.encode("x = [1, 22, 333]") == [104, 446, 933, 33, 28, 216, 34, 34, 28, 216, 35, 35, 35, 77]


def test_spaces_before_digits_differ_from_transformers_gguf(tok, hf_gguf_tok):
    # The Digits split runs first, so "a   " keeps its spaces together as 'ĠĠĠ' (333).
    # Without it (transformers' GGUF conversion) the GPT-2 regex gives " 123" its own
    # space: 'ĠĠ' (256) + 'Ġ' (216).
    assert tok.encode("a   123") == [81, 333, 33, 34, 35]
    assert hf_gguf_tok("a   123", add_special_tokens=False)["input_ids"] == [81, 256, 216, 33, 34, 35]
    assert tok.encode("cost:    42") == [11386, 42, 289, 36, 34]  # 'ĠĠĠĠ', '4', '2'
    assert tok.encode("\t7") == [197, 39]


def test_unicode_numerals_are_split_one_per_char(tok):
    # Digits() splits on every Unicode numeric char (\p{N}), not just ASCII: ², ³, ½.
    assert tok.encode("x²³½") == [104, 19133, 39050, 16738]
    assert tok.convert_ids_to_tokens([19133, 39050, 16738]) == ["Â²", "Â³", "Â½"]
    assert tok.encode("ⅫⅣ") == [173, 223, 121, 173, 223, 113]  # each numeral's three bytes


def test_converted_dir_loads_in_transformers_with_same_ids(tok, hf_converted_tok):
    """tokenizer.json is taken as-is by transformers, digit split included."""
    texts = NO_DIGIT_TEXTS + ["a   123", "x²³½", "Version 3.14 released in 2024", "  42  "]
    for text in texts:
        assert tok.encode(text) == hf_converted_tok(text, add_special_tokens=False)["input_ids"], text


@pytest.mark.parametrize(
    "text",
    NO_DIGIT_TEXTS + ["a   123", "   42", "x²³½", "π ≈ 3.14159", "12:30pm, 1,000,000 items", "١٢٣ ४५६"],
)
def test_decode_roundtrip(tok, text):
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_skip_special_tokens(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_add_special_tokens_adds_no_bos(tok):
    # add_bos_token is false in the GGUF metadata (the chat template writes <|im_start|>).
    assert tok.add_bos_token is False
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi") == [6004]


def test_special_ids(tok):
    assert tok.vocab_size == len(tok) == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_id == 2
    assert tok.eos_token_ids == {2}
    assert tok.pad_token_id == 2
    assert tok.unk_token_id == 0
    assert tok.all_special_ids == list(range(17))
    assert tok.convert_ids_to_tokens(1) == "<|im_start|>"
    assert tok.convert_tokens_to_ids(["<|im_end|>", "Ġworld", "no-such-token"]) == [2, 905, None]


def test_eos_token_ids_merge_generation_config(tok):
    other = Tokenizer(tok._tok, tok.config, {"eos_token_id": [0, 2, 5]})
    assert other.eos_token_ids == {0, 2, 5}
    assert Tokenizer(tok._tok, {}, {"eos_token_id": 7}).eos_token_ids == {7}
    assert Tokenizer(tok._tok, {}, {"eos_token_id": 7}).eos_token_id == 7


# --- chat template ------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "  and   3 + 3?  \n"},
    ],
    [{"role": "user", "content": "emoji 👨\u200d👩\u200d👧 and 中文"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_converted_tok, messages, add_generation_prompt):
    expected = hf_converted_tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == hf_converted_tok(expected, add_special_tokens=False)["input_ids"]


def test_chat_template_default_system_prompt(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)[:2] == [1, 9690]


def test_chat_template_environment(tok):
    """The transformers environment: raise_exception, HTML-safe tojson, special token vars,
    trim_blocks/lstrip_blocks, and a sandbox."""
    t = Tokenizer(tok._tok, {**tok.config, "chat_template": (
        "{% if messages|length == 0 %}{{ raise_exception('no messages') }}{% endif %}\n"
        "  {% for m in messages %}\n{{ bos_token }}{{ m | tojson }}{{ eos_token }}\n{% endfor %}"
    )})
    assert t.apply_chat_template([{"role": "user", "content": "<&>"}]) == (
        '<|im_start|>{"role": "user", "content": "<&>"}<|im_end|>\n'  # trim_blocks eats only the
    )  # newlines after block tags, lstrip_blocks the indent before one
    with pytest.raises(jinja2.TemplateError, match="no messages"):
        t.apply_chat_template([])
    evil = Tokenizer(tok._tok, {"chat_template": "{{ messages.__class__.__mro__ }}"})
    with pytest.raises(jinja2.exceptions.SecurityError):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


# --- bad input ----------------------------------------------------------------------------


def test_missing_tokenizer_json_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_no_chat_template(tok):
    bare = Tokenizer(tok._tok, {})
    with pytest.raises(ValueError, match="no chat_template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def test_bad_messages(tok):
    with pytest.raises(ValueError, match="list of dicts"):
        tok.apply_chat_template("hello")


def test_id_out_of_range(tok):
    with pytest.raises(ValueError, match="49152"):
        tok.convert_ids_to_tokens([49152])


def test_unknown_special_token_in_config(tok):
    with pytest.raises(ValueError, match="<nope>"):
        Tokenizer(tok._tok, {"eos_token": "<nope>"})


# --- token_bytes: each token's own bytes ---------------------------------------------------

def test_byte_level_decoder_is_the_byte_level_alphabet():
    import tokenizers

    from refengine.tokenizer import byte_level_decoder

    table = byte_level_decoder()
    assert set(table) == set(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    assert sorted(table.values()) == list(range(256))
    assert (table["Ġ"], table["Ċ"], table["a"]) == (32, 10, 97)


@pytest.mark.parametrize("text", NO_DIGIT_TEXTS + ["😀", "tab\tand\x00nul 123"])
def test_token_bytes_rebuild_the_text_byte_level(tok, text):
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


def test_token_bytes_of_an_emoji_split_over_tokens(tok):
    ids = tok.encode("😀")
    assert [tok.decode([i]) for i in ids] == ["\ufffd"] * 3  # alone, each is part of a character
    assert [tok.token_bytes(i) for i in ids] == [b"\xf0\x9f", b"\x98", b"\x80"]
    assert tok.token_bytes(tok.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.token_bytes(tok.vocab_size)


def test_token_bytes_sentencepiece_byte_fallback():
    """Gemma's pipeline (refengine/formats/gguf_file.py ``_gemma_bpe``): ``<0xNN>`` byte
    tokens are their byte, other pieces their text with ``▁`` as a space."""
    import tokenizers
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁": 257, "a": 258, "▁a": 259, "é": 260}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], unk_token="<unk>", fuse_unk=True,
                                              byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    sp = Tokenizer(backend)
    ids = sp.encode("a a 😀é")
    assert ids == [258, 259, 257, 1 + 0xF0, 1 + 0x9F, 1 + 0x98, 1 + 0x80, 260]
    assert [sp.token_bytes(i) for i in ids[:4]] == [b"a", b" a", b" ", b"\xf0"]
    assert b"".join(sp.token_bytes(i) for i in ids) == "a a 😀é".encode()
