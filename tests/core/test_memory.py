"""What stays resident in the process: the GGUF file's memory map after the weights are
copied out of it (refengine/formats/gguf_file.py) and the KV pool's first pages
(refengine/cpu/malloc.py). Read from ``/proc/self/smaps`` (Linux)."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def _vmas():
    """``[(start, end, path, {field: value})]`` of this process's mappings (smaps, kB values)."""
    out = []
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):
                start, end = (int(a, 16) for a in parts[0].split("-"))
                out.append((start, end, parts[5] if len(parts) > 5 else "", {}))
            elif parts[0] == "VmFlags:":
                out[-1][3]["VmFlags"] = parts[1:]
            elif parts[0].endswith(":") and len(parts) >= 2 and parts[1].isdigit():
                out[-1][3][parts[0][:-1]] = int(parts[1])
    return out


def _vma_at(address: int):
    return next(v for v in _vmas() if v[0] <= address < v[1])


def test_gguf_weights_leave_no_page_of_the_file_resident(gguf_path):
    """Each tensor's pages of the map are dropped once copied (``madvise(MADV_DONTNEED)``),
    the header's once parsed: the load never holds the file's 98 MB beside the copies."""
    from refengine.formats.gguf_file import GGUFFile

    if not hasattr(mmap, "MADV_DONTNEED"):
        pytest.skip("no madvise here")
    gguf = GGUFFile(gguf_path)
    view = gguf.reader.tensors[0].data
    while isinstance(view, np.ndarray):
        view = view.base
    buf = view.obj if isinstance(view, memoryview) else view
    start = np.frombuffer(buf, dtype=np.uint8, count=1).ctypes.data  # this file object's own map
    end = start + len(buf)

    def file_rss_kb():
        return sum(v[3].get("Rss", 0) for v in _vmas() if start <= v[0] < end)

    assert file_rss_kb() < 1024  # the header, parsed into copies
    weights = gguf.weights()
    assert len(weights) == 272
    assert file_rss_kb() < 1024, file_rss_kb()  # before: the whole file (96,000 kB)
    t = gguf.reader.tensors[5]
    assert int(np.asarray(t.data).reshape(-1).view(np.uint8)[:64].sum()) >= 0  # the view still reads (faulted back in)


def test_kv_pool_first_pages_are_small_pages():
    """A short run writes only the first blocks of each layer's pool: in 4 KB pages that
    costs what it writes, in 2 MB pages a whole huge page per array (30 layers x K and V x
    2 MB for SmolLM2). Past :data:`SMALL_PAGE_PREFIX` the pool is advised huge pages."""
    from refengine.attention import kv_cache as malloc  # the KV pool's allocator

    a = malloc.huge_page_zeros((1024, 16, 3, 64), np.float32)  # 12 MB
    assert a.ctypes.data % malloc.HUGE_PAGE == 0 or not hasattr(mmap, "MADV_HUGEPAGE")
    a[0, 0, 0, 0] = 1.0  # the first block, as a run's first token
    first = _vma_at(a.ctypes.data)
    assert first[3]["Rss"] <= 8, first  # kB: one small page (before: 2048, a huge page)
    assert first[3].get("AnonHugePages", 0) == 0
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert "hg" not in first[3]["VmFlags"]
        past = _vma_at(a.ctypes.data + malloc.SMALL_PAGE_PREFIX)
        assert "hg" in past[3]["VmFlags"]  # the rest of the pool: huge pages where the kernel grants them
    a[-1, -1, -1, -1] = 2.0
    assert a.sum() == 3.0 and a.flags.c_contiguous and a.shape == (1024, 16, 3, 64)
