"""Checks on text that users hand to the engine."""

from __future__ import annotations


def check_unicode(text: str, what: str) -> None:
    """Refuse a ``str`` that is not valid Unicode: one holding a lone surrogate (U+D800 to
    U+DFFF). Python makes those of bytes that are not UTF-8 (``surrogateescape``: command
    line arguments, file names) and of broken UTF-16 pairs; no tokenizer can encode them.

    Args:
        text: the text to check.
        what: how the message names it (``"the prompt"``).
    Raises:
        ValueError: naming ``what``, the character's position and, for an undecodable
            byte, the byte.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        byte = f": the byte 0x{code - 0xDC00:02X} is not UTF-8" if 0xDC80 <= code <= 0xDCFF else ""
        raise ValueError(f"{what} is not valid Unicode: lone surrogate U+{code:04X} at position {e.start}"
                         f"{byte}") from None
