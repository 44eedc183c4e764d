"""EngineArgs: every engine option declared once, validated before anything is allocated, and
the same errors from Python and from every CLI command that builds an engine."""

from __future__ import annotations

import dataclasses
import re

import click
import pytest
from click.testing import CliRunner

from refengine import LLM
from refengine.cli import main
from refengine.engine_args import EngineArgs

BAD_COMBINATIONS = [
    # (Python keyword arguments, CLI flags, what the message must name in Python, and from the CLI)
    ({"device": "cpu", "attention_backend": "cuda"}, ["--device", "cpu", "--attention-backend", "cuda"],
     r"attention_backend='cuda' runs on device='cuda', not on device='cpu'",
     r"--attention-backend='cuda' runs on --device='cuda', not on --device='cpu'"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 32, "max_model_len": 64},
     ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "32", "--max-model-len", "64"],
     r"enable_chunked_prefill=False, max_num_batched_tokens=32 must be >= max_model_len=64",
     r"--no-enable-chunked-prefill, --max-num-batched-tokens=32 must be >= --max-model-len=64"),
    ({"block_size": 0}, ["--block-size", "0"], r"block_size=0 is invalid: must be an integer >= 1",
     r"--block-size=0 is invalid: must be an integer >= 1"),
    ({"kv_cache_memory": 100}, ["--kv-cache-memory", "100"], r"kv_cache_memory=100 bytes holds no KV block",
     r"--kv-cache-memory=100 bytes holds no KV block"),
    ({"gpu_memory_utilization": 1.5}, ["--gpu-memory-utilization", "1.5"],
     r"gpu_memory_utilization=1.5 is invalid: must be a finite number in \(0, 1.0\]",
     r"--gpu-memory-utilization=1.5 is invalid: must be a finite number in \(0, 1.0\]"),
    ({"max_model_len": 100_000}, ["--max-model-len", "100000"],
     r"max_model_len=100000 exceeds the model's context \(max_position_embeddings=256",
     r"--max-model-len=100000 exceeds the model's context \(max_position_embeddings=256"),
]


@pytest.mark.parametrize("kwargs, flags, message, cli_message", BAD_COMBINATIONS)
def test_bad_values_and_pairs_from_python(tiny_llama_dir, kwargs, flags, message, cli_message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_llama_dir, **kwargs)


def test_unknown_option_is_named():
    with pytest.raises(ValueError, match=r"unknown engine option\(s\) 'max_num_seq'; engine options are: .*max_num_seqs"):
        LLM("unused", max_num_seq=4)


def test_wrong_types_are_refused_before_loading():
    for kwargs, message in [({"block_size": True}, "block_size=True is invalid: must be an integer >= 1, got bool"),
                            ({"max_num_seqs": 2.5}, "max_num_seqs=2.5 is invalid: must be an integer >= 1, got float"),
                            ({"device": "tpu"}, "device='tpu' is not one of 'cpu', 'cuda', 'auto'"),
                            ({"gpu_memory_utilization": float("nan")},
                             r"gpu_memory_utilization=nan is invalid: must be a finite number in \(0, 1.0\]")]:
        with pytest.raises(ValueError, match=message):
            EngineArgs(**kwargs)


COMMANDS = [["generate", "hi"], ["chat"], ["bench", "throughput", "--num-prompts", "1"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("kwargs, flags, message, cli_message", BAD_COMBINATIONS)
def test_bad_values_and_pairs_from_every_cli_command(tiny_llama_dir, command, kwargs, flags, message, cli_message):
    """The same errors, naming the flags as typed: one Error: line, exit status 2 (issue 11)."""
    res = CliRunner().invoke(main, command + ["--model", str(tiny_llama_dir), *flags])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    errors = res.stderr.splitlines()
    assert len(errors) == 1 and errors[0].startswith("Error:") and re.search(cli_message, errors[0]), res.output


def test_every_command_that_builds_an_engine_has_every_engine_flag():
    flags = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(EngineArgs)
             if f.name not in ("log_stats", "trace")}
    flags.add("--disable-log-stats")
    bench = main.get_command(None, "bench")
    commands = [main.commands["generate"], main.commands["chat"], main.commands["serve"],
                # bench serve is an HTTP client; bench kernels times bare models, no engine; bench
                # peers runs fixed settings per engine (refengine beside llama.cpp and CTranslate2)
                *(c for name, c in bench.commands.items() if name not in ("serve", "kernels", "peers"))]
    for command in commands:
        have = {opt for p in command.params if isinstance(p, click.Option) for opt in p.opts}
        assert flags <= have, (command.name, flags - have)


def test_resolved_config_is_frozen_and_complete(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, block_size=4, num_kv_blocks=12, log_stats=False)
    cfg = llm.llm_engine.config
    assert (cfg.device, cfg.attention_backend, cfg.layer_ops, cfg.num_kv_blocks) == ("cpu", "numba", "numba", 12)
    assert cfg.max_model_len == 48 and cfg.max_num_batched_tokens == 2048  # pool-capped; the default budget
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 8
