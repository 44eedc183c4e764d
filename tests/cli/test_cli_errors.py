"""The command line explains itself (issue 11): every bad flag value is one ``Error:`` line
naming the flag as typed, exit status 2, no usage block, no traceback, found before the model
is loaded; text that is not UTF-8 is refused (chat keeps its history); answers cut by a length
limit say which; every option has help and shows its default."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from refengine import __version__
from refengine.cli import main
from refengine.engine_args import EngineArgs

COMMANDS = [["generate", "hi"], ["chat"], ["bench", "throughput", "--num-prompts", "1", "--input-len", "8",
                                           "--output-len", "8"], ["serve"]]


@pytest.fixture
def no_model_load(monkeypatch):
    """A bad flag must be found before the weights are read."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad flag was found")

    monkeypatch.setattr("refengine.core.engine.load_model", refuse)


def one_error_line(res, flag: str | None = None) -> str:
    """The run failed with exit status 2 and exactly one line, ``Error: ...`` (naming ``flag``)."""
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert "Traceback" not in res.output and "Usage:" not in res.output, res.output
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.stderr
    if flag is not None:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", lines[0]), lines[0]
    return lines[0]


# --- every engine flag and every sampling flag, through every command -----------------------

def bad_engine_flag_values(fld: dataclasses.Field) -> list[str]:
    kind = str(fld.type).split("|")[0].strip()
    if fld.metadata["choices"]:
        return ["tpu", ""]
    if kind == "int":
        return ["abc", "1.5", "-1"] + (["0"] if fld.metadata["minimum"] == 1 else [])
    if kind == "float":
        return ["abc", "nan", "inf", "-0.5", "0"]
    return [""] if kind == "str" else []


ENGINE_FLAG_CASES = [("--" + f.name.replace("_", "-"), v) for f in dataclasses.fields(EngineArgs)
                     if f.metadata["cli"] for v in bad_engine_flag_values(f)]
ENGINE_FLAG_CASES += [  # right type, but no engine can run with it
    ("--block-size", str(10**12)), ("--max-model-len", str(10**12)), ("--num-kv-blocks", str(10**12)),
    ("--kv-cache-memory", str(10**18)), ("--kv-cache-memory", "1"), ("--max-model-len", "300"),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("flag, value", ENGINE_FLAG_CASES, ids=str)
def test_bad_engine_flag(tiny_llama_tok_dir, no_model_load, command, flag, value):
    res = CliRunner().invoke(main, [*command, "--model", str(tiny_llama_tok_dir), flag, value])
    one_error_line(res, flag if flag != "--model" else None)


SAMPLING_FLAG_CASES = [
    ("--max-tokens", ["abc", "1.5", "0", "-1"]),
    ("--min-tokens", ["abc", "-1", "300"]),  # 300 > --max-tokens' 256
    ("--temperature", ["abc", "nan", "inf", "-0.5"]),
    ("--top-p", ["abc", "nan", "inf", "0", "-0.5", "1.5"]),
    ("--top-k", ["abc", "1.5", "-2"]),
    ("--min-p", ["abc", "nan", "inf", "-0.5", "1.5"]),
    ("--seed", ["abc", "1.5", "-1", str(2**64)]),
    ("--presence-penalty", ["abc", "nan", "inf", "2.5", "-2.5"]),
    ("--frequency-penalty", ["abc", "nan", "inf", "2.5", "-2.5"]),
    ("--repetition-penalty", ["abc", "nan", "inf", "0", "-1"]),
    ("--stop", ["", "caf\udce9"]),
    ("--stop-token-ids", ["x", "1,y", "-1", "1,-5", str(10**9)]),
]


@pytest.mark.parametrize("command", COMMANDS[:2], ids=lambda c: c[0])
@pytest.mark.parametrize("flag, value", [(f, v) for f, vs in SAMPLING_FLAG_CASES for v in vs], ids=str)
def test_bad_sampling_flag(tiny_llama_tok_dir, no_model_load, monkeypatch, command, flag, value):
    if flag == "--stop-token-ids" and value == str(10**9):  # checked against the vocabulary, so after loading
        monkeypatch.undo()
    res = CliRunner().invoke(main, [*command, "--model", str(tiny_llama_tok_dir), flag, value])
    line = one_error_line(res, flag)
    assert "SamplingParams" not in line  # the flag, not the Python field


@pytest.mark.parametrize("args, message", [
    (["--logprobs", "100", "--json"], r"Error: --logprobs=100 is more than this engine's --max-logprobs=20"),
    (["--logprobs", "2"], r"Error: --logprobs needs --json: log-probabilities are printed only in the JSON output"),
    (["--logprobs", "-1", "--json"], r"Error: --logprobs=-1 is invalid: must be None or an integer >= 0"),
])
def test_logprobs_flag(tiny_llama_tok_dir, args, message):
    res = CliRunner().invoke(main, ["generate", "--model", str(tiny_llama_tok_dir), *args, "hi"])
    assert re.match(message, one_error_line(res, "--logprobs"))


def test_chat_refuses_logprobs(tiny_llama_tok_dir, no_model_load):
    res = CliRunner().invoke(main, ["chat", "--model", str(tiny_llama_tok_dir), "--logprobs", "2"])
    assert one_error_line(res) == ("Error: --logprobs is not shown by chat: use "
                                   "`refengine generate --json --logprobs N`")


@pytest.mark.parametrize("args, message", [
    (["generate", "--model", "/nonexistent/model", "hi"], r"Error: model directory '/nonexistent/model' does not exist"),
    (["generate", "--nope", "hi"], r"Error: No such option '--nope'"),
    (["generate"], r"Error: Missing argument 'PROMPTS\.\.\.'"),
    (["nope"], r"Error: No such command 'nope'"),
    (["generate", "--top-p"], r"Error: Option '--top-p' requires an argument"),
    (["--log-level", "loud", "generate", "hi"], r"Error: Invalid value for '--log-level': 'loud' is not one of"),
    (["convert-gguf", "/nonexistent.gguf", "/tmp/x"], r"Error: .*/nonexistent.gguf"),
])
def test_usage_errors_are_one_line(args, message):
    res = CliRunner().invoke(main, args)
    assert re.match(message, one_error_line(res)), res.stderr


def test_prompt_errors_name_the_prompt(tiny_llama_tok_dir):
    res = CliRunner().invoke(main, ["generate", "--model", str(tiny_llama_tok_dir), "hi", "x" * 300])
    assert one_error_line(res, "--max-model-len") == (
        "Error: prompt 2: the prompt has 300 tokens but --max-model-len is 256: it must be shorter than 256 to "
        "leave room for one generated token")


# --- bench checks its flags before loading the model ---------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--num-prompts", "0"], r"Error: Invalid value for '--num-prompts': 0 is not in the range x>=1"),
    (["--device", "tpu"], r"Error: Invalid value for '--device': 'tpu' is not one of 'cpu', 'cuda', 'auto'"),
    (["--input-len", "9000"], r"Error: the longest request \(--input-len up to 9000 \+ --output-len up to 16 = "
                              r"9016 tokens\) does not fit the model's context of 256 tokens"),
    (["--input-len", "100", "--max-model-len", "64"],
     r"Error: the longest request \(--input-len up to 100 \+ --output-len up to 16 = 116 tokens\) does not fit "
     r"--max-model-len=64"),
    (["--input-len", "9-3"], r"Error: Invalid value for '--input-len': length range 9-3 is invalid"),
    (["--max-concurrency", "0"], r"Error: Invalid value for '--max-concurrency'"),
    (["--seed", "-1"], r"Error: Invalid value for '--seed'"),
    (["--dataset-dir", "/nonexistent"], r"Error: Invalid value for '--dataset-dir': Directory '/nonexistent' does "
                                        r"not exist"),
    (["--json", "/nonexistent/r.json"], r"Error: Invalid value for '--json': the directory '/nonexistent' does not"),
    (["--hf-batch-size", "0"], r"Error: Invalid value for '--hf-batch-size'"),
    (["--kv-cache-memory", "1"], r"Error: --kv-cache-memory=1 bytes holds no KV block"),
    (["--dtype", "float16"], r"Error: --dtype='float16' is not supported on the CPU"),
])
def test_bench_checks_flags_before_loading(tiny_llama_tok_dir, no_model_load, args, message):
    res = CliRunner().invoke(main, ["bench", "throughput", "--model", str(tiny_llama_tok_dir),
                                    "--output-len", "16", *args])
    assert re.match(message, one_error_line(res)), res.stderr


def test_compare_without_torch_names_the_extra(tiny_llama_tok_dir, no_model_load, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now fails; find_spec says None
    res = CliRunner().invoke(main, ["bench", "throughput", "--model", str(tiny_llama_tok_dir),
                                    "--compare-transformers"])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert res.stderr == ("Error: --compare-transformers needs torch and transformers, which are not installed: "
                          "pip install 'refengine[compare]'\n")


# --- text that is not UTF-8 ---------------------------------------------------------------------

@pytest.mark.parametrize("args, name", [
    (["generate", "caf\udce9 au lait"], "PROMPTS..."),
    (["generate", "--stop", "\udce9", "hi"], "--stop"),
    (["chat", "--system", "x\udcff"], "--system"),
])
def test_command_line_text_must_be_utf8(tiny_llama_tok_dir, no_model_load, args, name):
    """Python hands undecodable argv bytes over as lone surrogates (surrogateescape)."""
    res = CliRunner().invoke(main, [args[0], "--model", str(tiny_llama_tok_dir), *args[1:]])
    line = one_error_line(res)
    assert line.startswith(f"Error: Invalid value for '{name}': ") and "is not valid Unicode: lone surrogate" in line
    assert re.search(r"at position \d+: the byte 0x(E9|FF) is not UTF-8", line), line


def test_chat_refuses_a_line_that_is_not_utf8_and_keeps_the_history(tiny_llama_tok_dir, monkeypatch):
    from refengine.tokenizer import Tokenizer

    seen = []
    real = Tokenizer.apply_chat_template

    def spy(self, messages, *args, **kwargs):
        seen.append([m["content"] for m in messages])
        return real(self, messages, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "apply_chat_template", spy)
    res = CliRunner().invoke(main, ["chat", "--model", str(tiny_llama_tok_dir), "--max-tokens", "2",
                                    "--ignore-eos", "--disable-log-stats"],
                             input=b"hello\ncaf\xe9 au lait\nagain\n/exit\n")
    assert res.exit_code == 0, res.output
    assert ("error: this line is not valid Unicode: lone surrogate U+DCE9 at position 3: the byte 0xE9 is not "
            "UTF-8; it was not sent (the history is kept)") in res.stderr
    assert len(seen) == 2 and seen[0] == ["hello"]
    assert seen[1][0] == "hello" and seen[1][2] == "again" and len(seen[1]) == 3  # the first turn is still there


def test_str_prompt_with_a_lone_surrogate_from_python(tiny_llama_tok_dir):
    from refengine import LLM

    llm = LLM(tiny_llama_tok_dir, log_stats=False)
    with pytest.raises(ValueError, match=r"the prompt is not valid Unicode: lone surrogate U\+D800 at position 2"):
        llm.generate("ab\ud800c", use_tqdm=False)


# --- answers cut by a limit say which ------------------------------------------------------------

@pytest.mark.parametrize("args, note", [
    (["--max-tokens", "3"], "[finish_reason=length: the answer reached --max-tokens=3]"),
    (["--max-model-len", "8", "--max-tokens", "50"],
     "[finish_reason=length: prompt (5) + answer (3) tokens reached max_model_len=8 (set by --max-model-len)]"),
    (["--num-kv-blocks", "3", "--block-size", "4", "--max-tokens", "50"],
     "[finish_reason=length: prompt (5) + answer (7) tokens reached max_model_len=12 (what the KV pool holds: "
     "raise --kv-cache-memory or --num-kv-blocks)]"),
    (["--max-tokens", "300"],
     "[finish_reason=length: prompt (5) + answer (251) tokens reached max_model_len=256 (the model's context)]"),
])
def test_generate_says_which_limit_cut_the_answer(tiny_llama_tok_dir, args, note):
    res = CliRunner().invoke(main, ["generate", "--model", str(tiny_llama_tok_dir), "--ignore-eos",
                                    "--disable-log-stats", *args, "hello"])
    assert res.exit_code == 0, res.output
    assert note in res.stderr.splitlines()


def test_chat_says_when_the_history_no_longer_fits(tiny_llama_tok_dir):
    res = CliRunner().invoke(main, ["chat", "--model", str(tiny_llama_tok_dir), "--ignore-eos", "--max-tokens", "100",
                                    "--max-model-len", "40", "--disable-log-stats"], input="hello\nmore\n/exit\n")
    assert res.exit_code == 0, res.output
    err = res.stderr.splitlines()
    # "user hello assistant " is 21 characters, one token each
    assert ("[finish_reason=length: prompt (21) + answer (19) tokens reached max_model_len=40 (set by "
            "--max-model-len); the next turn will not fit: /reset clears the history]") in err
    assert any(line.startswith("error: the prompt has ") and line.endswith(
        "but --max-model-len is 40: it must be shorter than 40 to leave room for one generated token "
        "(/reset clears the history)") for line in err), err


def test_summary_reports_totals_and_medians(tiny_llama_tok_dir):
    res = CliRunner().invoke(main, ["generate", "--model", str(tiny_llama_tok_dir), "--ignore-eos",
                                    "--disable-log-stats", "--max-tokens", "4", "--json", "hello", "abc", "x"])
    assert res.exit_code == 0, res.output
    outs = [json.loads(line) for line in res.stdout.splitlines()]
    summary = res.stderr.splitlines()[-1]
    m = re.fullmatch(r"3 request\(s\): 9 prompt \+ 12 output tokens in [\d.]+ s \([\d.]+ output tokens/s\); "
                     r"per request, median TTFT ([\d.]+) ms, median TPOT ([\d.]+) ms", summary)
    assert m, summary
    ttfts = sorted(o["metrics"]["ttft"] * 1e3 for o in outs)
    assert float(m.group(1)) == pytest.approx(ttfts[1], abs=0.051)  # the median, not request 0's


# --- the CLI explains itself --------------------------------------------------------------------

def all_commands():
    main.get_command(click.Context(main), "bench")  # load the lazy group
    yield main
    for cmd in main.commands.values():
        yield cmd
        if isinstance(cmd, click.Group):
            yield from cmd.commands.values()


def test_every_option_has_help_and_shows_its_default():
    for cmd in all_commands():
        for p in cmd.params:
            if not isinstance(p, click.Option) or p.name in ("help", "version"):
                continue
            assert p.help, (cmd.name, p.opts)
            assert p.show_default or "default" in p.help, (cmd.name, p.opts)


def test_version():
    res = CliRunner().invoke(main, ["--version"])
    assert res.exit_code == 0 and res.output == f"refengine {__version__}\n"


@pytest.mark.parametrize("where", ["before", "after"])
def test_log_level_before_or_after_the_command(tiny_llama_tok_dir, where):
    """In a real process: pytest's own logging handlers would hide what the CLI sets up."""
    import subprocess

    args = ["generate", "--model", str(tiny_llama_tok_dir), "--max-tokens", "2", "hi"]
    args = ["--log-level", "info", *args] if where == "before" else [*args, "--log-level", "info"]
    res = subprocess.run([sys.executable, "-m", "refengine.cli", *args], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])  # this checkout's refengine
    assert res.returncode == 0, res.stderr
    assert any(line.startswith("INFO ") and "request 0 finished" in line for line in res.stderr.splitlines())


def test_no_progress_bars_when_stderr_is_not_a_terminal(tiny_llama_tok_dir, capfd):
    from refengine import LLM
    from refengine.bench.driver import run_engine
    from refengine.bench.workload import BenchRequest

    llm = LLM(tiny_llama_tok_dir, log_stats=False)
    assert not sys.stderr.isatty()
    llm.generate(["hi", "abc"], use_tqdm=True)
    run_engine(llm.llm_engine, [BenchRequest("a", [5, 6], 2)], progress=True)
    assert capfd.readouterr().err == ""
