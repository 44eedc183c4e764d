"""benchmarks/load_test.py's own helpers: the metrics it reads, the memory it sums, its
refusal of bad options."""

from __future__ import annotations

import pytest


def _load_test_module():
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "load_test.py"
    spec = importlib.util.spec_from_file_location("load_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["load_test"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_load_test_reads_metrics_and_memory():
    import os

    lt = _load_test_module()
    text = ("# HELP refengine:kv_cache_usage_perc x\n# TYPE refengine:kv_cache_usage_perc gauge\n"
            "refengine:kv_cache_usage_perc 0.25\nrefengine:num_requests_running_total 3.0\n"
            'refengine:num_requests_running{model_name="m"} 2.0\n')
    assert lt.metric_value(text, "refengine:kv_cache_usage_perc") == 0.25
    assert lt.metric_value(text, "refengine:num_requests_running") == 2.0  # not the _total one
    assert lt.metric_value(text, "refengine:num_requests_waiting") is None
    with open(f"/proc/{os.getpid()}/status") as f:
        own = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    assert lt.tree_rss_bytes(os.getpid()) >= own > 0


def test_load_test_refuses_bad_options():
    lt = _load_test_module()
    with pytest.raises(SystemExit):
        lt.main(["--duration", "0"])
