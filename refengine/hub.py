"""Models by their Hugging Face Hub name: ``org/name[@revision]`` -> a local directory or GGUF file.

``vllm serve Qwen/Qwen2.5-0.5B-Instruct`` and ``transformers``' ``from_pretrained`` take Hub
ids; so does refengine's ``--model`` (and ``LLM(model=...)``), through ``huggingface_hub``
itself, so everything about the cache is that library's:

* where the cache is: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``;
* its layout: ``models--org--name/refs/<branch>`` holds a commit hash,
  ``snapshots/<commit>/<file>`` links to ``blobs/<sha>``;
* offline mode: with ``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE=1``) nothing is
  fetched (``local_files_only=True``) and only what the cache holds resolves; online, a
  Hub that cannot be reached falls back to the cache too (``huggingface_hub``'s rule).

Two kinds of repository:

* **safetensors** (``--model org/name``): the snapshot's ``*.json``, ``*.safetensors`` and
  ``*.jinja`` files (config, tokenizer, weights, chat template) -> the snapshot directory.
* **GGUF** (``--model org/name --gguf-file x.gguf``, ``transformers``' ``gguf_file`` name,
  or the one-argument spelling ``--model org/name/x.gguf``): that one file -> its path in
  the snapshot. A revision goes last in both: ``org/name@v1.0``, ``org/name/x.gguf@v1.0``.

What a name means is decided in :func:`parse_hub_id`; a string that exists as a local path
is always the path (``refengine.engine_args.resolve_model_dir`` looks there first).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

#: Files a safetensors model needs from its repository (README, images, other formats are skipped).
SNAPSHOT_PATTERNS = ("*.json", "*.safetensors", "*.jinja")

# The Hub's own rules for a repository id (huggingface_hub.utils.validate_repo_id): letters,
# digits, "-", "_", "." ; no "--" or ".." ; at most 96 characters; an owner and a name.
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_HUB_ID = re.compile(rf"(?P<repo>{_NAME}/{_NAME})(?:/(?P<file>[^/@]+\.gguf))?(?:@(?P<revision>[^@\s]+))?")


@dataclass(frozen=True)
class HubModel:
    """A model named on the Hub: ``repo_id`` (``org/name``), ``revision`` (branch, tag or
    commit; None: ``main``), ``gguf_file`` (a file in the repository, None for a
    safetensors model)."""

    repo_id: str
    revision: str | None = None
    gguf_file: str | None = None

    def __str__(self) -> str:
        name = self.repo_id + (f"/{self.gguf_file}" if self.gguf_file else "")
        return name + (f"@{self.revision}" if self.revision else "")


def parse_hub_id(model: str, gguf_file: str | None = None) -> HubModel | None:
    """``model`` read as a Hub name (``org/name``, ``org/name@rev``, ``org/name/x.gguf[@rev]``),
    or None when it is not one (an absolute path, ``./x``, ``~/x``, three or more parts not
    ending in ``.gguf``, ``..`` or ``--`` inside a part). Does not look at the disk: callers
    try ``model`` as a local path first.

    Args:
        gguf_file: a GGUF file name in the repository (``--gguf-file``); with it, ``model``
            must be a bare ``org/name[@rev]``.
    Raises:
        ValueError: ``gguf_file`` is not a plain ``*.gguf`` file name, or is given together
            with the ``org/name/x.gguf`` spelling.
    """
    if gguf_file is not None and (not gguf_file.endswith(".gguf") or "/" in gguf_file or "\\" in gguf_file
                                  or gguf_file.startswith(".")):
        raise ValueError(f"gguf_file={gguf_file!r} is invalid: must be a '.gguf' file name in the repository "
                         "(no directory)")
    m = _HUB_ID.fullmatch(model)
    if m is None or len(m["repo"]) > 96 or any(bad in m["repo"] for bad in ("--", "..")):
        return None
    if m["file"] and gguf_file:
        raise ValueError(f"model={model!r} names a GGUF file and gguf_file={gguf_file!r} names another: give one")
    return HubModel(m["repo"], m["revision"], m["file"] or gguf_file)


def resolve_hub_model(hub: HubModel, local_path_tried: str | None = None) -> Path:
    """The local path of ``hub``: its snapshot directory (safetensors) or its GGUF file,
    downloaded into the Hugging Face cache when missing and the Hub can be reached.

    Args:
        local_path_tried: the string that was tried as a local path first (named in the
            error, so a mistyped local directory is recognisable).
    Returns:
        ``.../models--org--name/snapshots/<commit>`` or ``.../snapshots/<commit>/x.gguf``.
    Raises:
        FileNotFoundError: the model is not in the cache and cannot be fetched (offline, no
            network, no such repository, revision or file, or a partial snapshot); the
            message names the repository, the revision, the missing file and the cache
            directory, and says how to fetch it.
        ImportError: ``huggingface_hub`` is not installed.
    """
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, HFValidationError

    offline = constants.is_offline_mode()
    where = (f"{hub.repo_id!r} (revision {hub.revision or 'main'}) in the Hugging Face cache "
             f"{constants.HF_HUB_CACHE}")
    local = f"no local path {local_path_tried!r}, and " if local_path_tried else ""
    fetch = f"hf download {hub.repo_id}" + (f" {hub.gguf_file}" if hub.gguf_file else "") + (
        f" --revision {hub.revision}" if hub.revision else "")
    how = (f"HF_HUB_OFFLINE is set, so nothing is downloaded: fetch it where the Hub is reachable "
           f"(`{fetch}`) and share the cache" if offline else f"fetch it with `{fetch}`")
    try:
        if hub.gguf_file:
            path = Path(hf_hub_download(hub.repo_id, hub.gguf_file, revision=hub.revision, local_files_only=offline))
        else:
            path = Path(snapshot_download(hub.repo_id, revision=hub.revision, allow_patterns=list(SNAPSHOT_PATTERNS),
                                          local_files_only=offline))
    except HFValidationError as e:
        raise FileNotFoundError(f"{local}model {str(hub)!r} is not a valid Hugging Face repository id: {e}") from None
    except (EntryNotFoundError, HfHubHTTPError, OSError) as e:  # LocalEntryNotFoundError is both
        what = f"file {hub.gguf_file!r} of " if hub.gguf_file else ""
        raise FileNotFoundError(f"{local}{what}{where} is missing ({type(e).__name__}: {_first_line(e)}); "
                                f"{how}") from None
    if not hub.gguf_file:  # a snapshot listed from the cache alone may lack files (no tree listing to check)
        missing = [f for f in ("config.json",) if not (path / f).is_file()]
        has_weights = any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file()
        if missing or not has_weights:
            missing += [] if has_weights else ["model.safetensors (or an index and its shards)"]
            raise FileNotFoundError(f"{local}{where} is incomplete: {', '.join(missing)} missing from {path}; {how}")
    return path


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "no message"
