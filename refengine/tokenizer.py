"""Tokenizer: a thin wrapper over a Hugging Face ``tokenizers.Tokenizer`` plus the chat template.

A model directory (as written by ``transformers`` or :mod:`refengine.formats.convert_gguf`) holds:

- ``tokenizer.json``: the whole text <-> id pipeline (normalizer, pre-tokenizer, BPE
  model, decoder, added/special tokens), run by the Rust ``tokenizers`` library;
- ``tokenizer_config.json``: special token strings (``bos_token`` ...), ``add_bos_token``,
  ``model_max_length`` and the jinja2 ``chat_template``;
- ``generation_config.json``: ``eos_token_id``, which may list several stop ids.

Chat templates are rendered the way ``transformers`` does
(``transformers/utils/chat_template_utils.py``): a sandboxed jinja2 environment with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson``
filter that does not escape HTML, the globals ``raise_exception`` and ``strftime_now``,
and the special token strings (``bos_token``, ``eos_token``, ``unk_token``,
``pad_token``) as template variables.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers

from refengine.config import read_generation_config, read_json_object

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template.

    Build it with :meth:`from_pretrained`. Ids are Python ints; ``encode`` never adds
    special tokens unless asked (chat templates already spell them out).
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        tokenizer_config: dict | None = None,
        generation_config: dict | None = None,
        config_source: str = "tokenizer_config.json",
    ):
        """Wrap an already built ``tokenizers.Tokenizer``.

        Args:
            tokenizer: the Rust tokenizer (from ``tokenizer.json``).
            tokenizer_config: parsed ``tokenizer_config.json`` (may be empty).
            generation_config: parsed ``generation_config.json`` (may be empty).
            config_source: where ``tokenizer_config`` came from, for error messages.

        Raises:
            ValueError: a special token named in ``tokenizer_config`` is not a string or not
                in the vocabulary; a chat template that is not a string.
        """
        self._tok = tokenizer
        self.config = dict(tokenizer_config or {})
        self.generation_config = dict(generation_config or {})

        # Special token strings; older configs store them as {"content": ..., ...} dicts.
        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_KEYS:
            value = self.config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if value is None:
                continue
            if not isinstance(value, str):
                raise ValueError(f"{config_source}: {key!r} must be a string, got {value!r}")
            if self._tok.token_to_id(value) is None:
                raise ValueError(f"{config_source}: {key} {value!r} is not in the vocabulary")
            self.special_tokens[key] = value

        self.chat_template: str | None = _chat_template(self.config.get("chat_template"), config_source)
        self.add_bos_token = bool(self.config.get("add_bos_token", False))
        self.add_eos_token = bool(self.config.get("add_eos_token", False))
        self.model_max_length: int | None = self.config.get("model_max_length")

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and, when present, ``tokenizer_config.json`` and
        ``generation_config.json`` from ``model_dir``.

        Raises:
            FileNotFoundError: ``model_dir/tokenizer.json`` does not exist.
            ValueError: a file that ``tokenizers`` cannot read (e.g. ``{}``) or that is not
                a JSON object, a special token named in the config that is not in the
                vocabulary, a chat template that is not a string; the message names the file.
        """
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {str(path)!r}")
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises a bare Exception ("Model missing" ...)
            raise ValueError(f"{path}: not a tokenizer file that the tokenizers library can read: {e}") from None
        config_path = model_dir / "tokenizer_config.json"
        return cls(tok, read_json_object(config_path) if config_path.is_file() else {},
                   read_generation_config(model_dir), config_source=str(config_path))

    # --- text <-> ids -----------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``.

        Special token strings inside ``text`` (``<|im_start|>``) become their single ids.
        With ``add_special_tokens``, the ``tokenizer.json`` post-processor runs, and BOS is
        prepended / EOS appended when ``tokenizer_config`` sets ``add_bos_token`` /
        ``add_eos_token`` (and they are not there already).
        """
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            bos, eos = self.bos_token_id, self.eos_token_id
            if self.add_bos_token and bos is not None and ids[:1] != [bos]:
                ids = [bos] + ids
            if self.add_eos_token and eos is not None and ids[-1:] != [eos]:
                ids = ids + [eos]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Bytes that do not form whole UTF-8 characters (a token that
        ends mid-character) come out as U+FFFD; stream with
        :class:`refengine.detokenizer.IncrementalDetokenizer` to avoid that."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | list[str]:
        """Vocabulary strings (byte-level, e.g. ``'Ġworld'``) of one id or a list of ids.

        Raises:
            ValueError: an id is outside the vocabulary.
        """
        if isinstance(ids, int):
            return self._id_to_token(ids)
        return [self._id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | None | list[int | None]:
        """Ids of vocabulary strings (``None`` for a string not in the vocabulary)."""
        if isinstance(tokens, str):
            return self._tok.token_to_id(tokens)
        return [self._tok.token_to_id(t) for t in tokens]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token: what OpenAI's chat ``logprobs`` give as ``bytes``, so
        that the bytes of a text's tokens, laid end to end, are the text's UTF-8 even where a
        character spans several tokens (an emoji is 3 byte-level tokens, each of which
        decodes alone to U+FFFD).

        - an added token (``<|im_end|>``): its content;
        - byte-level BPE (a ``ByteLevel`` decoder): each character of the vocabulary string
          mapped back to the byte it stands for (:func:`byte_level_decoder`);
        - byte fallback (a ``ByteFallback`` decoder): ``<0xNN>`` is the byte ``NN``, other
          pieces their string with ``▁`` as a space (a SentencePiece ``Replace`` or
          ``Metaspace`` decoder);
        - any other tokenizer: the token decoded alone.

        Raises:
            ValueError: ``token_id`` outside the vocabulary.
        """
        piece = self._id_to_token(int(token_id))
        kinds = self._decoder_kinds
        if int(token_id) in self._added_ids:
            return piece.encode("utf-8")
        if "ByteLevel" in kinds:
            table = byte_level_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        elif "ByteFallback" in kinds:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            if {"Replace", "Metaspace"} & kinds:
                piece = piece.replace(_SP_SPACE, " ")
            return piece.encode("utf-8")
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    @functools.cached_property
    def _decoder_kinds(self) -> frozenset[str]:
        """The ``type`` of the ``tokenizer.json`` decoder and of each decoder in its ``Sequence``."""
        decoder = self._tok.decoder
        if decoder is None:
            return frozenset()
        spec = json.loads(decoder.__getstate__())
        return frozenset([spec["type"], *(d["type"] for d in spec.get("decoders", ()))])

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self._tok.get_added_tokens_decoder())

    def _id_to_token(self, i: int) -> str:
        token = self._tok.id_to_token(i)
        if token is None:
            raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
        return token

    def __len__(self) -> int:
        return self.vocab_size

    # --- chat template ----------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render a conversation with the model's jinja2 chat template.

        Args:
            messages: ``[{"role": "user", "content": "..."}, ...]``.
            add_generation_prompt: end with the header that opens the assistant's turn.
                (Note the default is True here; ``transformers`` defaults to False.)
            tokenize: return token ids (``encode`` without extra special tokens, since the
                template writes them) instead of the string.
            **template_kwargs: extra template variables (``tools``, ``documents`` ...).

        Returns:
            The prompt string, or its ids when ``tokenize``.

        Raises:
            ValueError: the tokenizer has no chat template, or ``messages`` is not a list
                of dicts.
            jinja2.TemplateError: the template called ``raise_exception`` (for instance on
                a role order it does not accept) or failed to render.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json)")
        if isinstance(messages, (str, dict)) or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"messages must be a list of dicts, got {messages!r}")
        variables = {**self.special_tokens, **template_kwargs}
        text = _compile_template(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
        )
        return self.encode(text) if tokenize else text

    @functools.cached_property
    def chat_template_variables(self) -> frozenset[str]:
        """The variables the chat template reads without setting them (``messages``,
        ``add_generation_prompt``, ``tools`` ...), from its syntax tree
        (``jinja2.meta.find_undeclared_variables``); empty without a template. A template
        that reads ``tools`` takes transformers' ``apply_chat_template(tools=...)``."""
        if self.chat_template is None:
            return frozenset()
        from jinja2 import meta

        return frozenset(meta.find_undeclared_variables(_template_environment().parse(self.chat_template)))

    # --- ids of note ------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (49152 for SmolLM2)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's EOS (``tokenizer_config`` ``eos_token``), else the first
        ``generation_config`` ``eos_token_id``."""
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._special_id("unk_token")

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation: ``generation_config`` ``eos_token_id`` (an int or
        a list) together with the tokenizer's ``eos_token``."""
        ids = set(_as_list(self.generation_config.get("eos_token_id")))
        if "eos_token" in self.special_tokens:
            ids.add(self._tok.token_to_id(self.special_tokens["eos_token"]))
        return ids

    @property
    def all_special_ids(self) -> list[int]:
        """Sorted ids of every added token marked special in ``tokenizer.json`` (those
        that ``decode(skip_special_tokens=True)`` drops), plus the named special tokens."""
        ids = {i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special}
        ids.update(self._tok.token_to_id(t) for t in self.special_tokens.values())
        return sorted(ids)

    def _special_id(self, key: str) -> int | None:
        if key in self.special_tokens:
            return self._tok.token_to_id(self.special_tokens[key])
        ids = _as_list(self.generation_config.get(f"{key}_id"))
        return ids[0] if ids else None

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, special_tokens={self.special_tokens})"


#: SentencePiece's word boundary (U+2581), which its decoders turn into a space.
_SP_SPACE = "\u2581"


@functools.cache
def byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet inverted: the printable character that stands for each
    of the 256 bytes -> that byte. GPT-2's ``bytes_to_unicode`` (openai/gpt-2
    ``src/encoder.py``), which the ``tokenizers`` ``ByteLevel`` pre-tokenizer and decoder
    use: printable Latin-1 bytes stand for themselves, the other 68 for ``chr(256 + i)``
    in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


def _chat_template(value, source: str) -> str | None:
    """``tokenizer_config.json``'s ``chat_template``: a string, or a list of named templates
    (``[{"name": "default", "template": ...}, ...]``) of which the default one is used."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ValueError(f"{source}: 'chat_template' must be a string or a list of named templates "
                     f"with a 'default' one, got {type(value).__name__}")


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


@functools.lru_cache(maxsize=8)
def _compile_template(source: str):
    """Compile a chat template in the environment ``transformers`` uses (see module doc)."""
    return _template_environment().from_string(source)


@functools.cache
def _template_environment():
    """The jinja2 environment ``transformers`` renders chat templates in (see module doc).

    Chat templates come from model repositories, so they are untrusted code: the sandbox
    blocks attribute access to Python internals, and "immutable" blocks mutating the
    caller's lists and dicts.
    """
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes <, >, & for HTML, which would corrupt prompts.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env
