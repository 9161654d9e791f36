"""The `pagellm` command in-process on a tiny model: generate, chat, bench throughput, errors."""

from __future__ import annotations

import json

import pytest

from pagellm.entrypoints.cli import main

ENGINE = ["--dtype", "float32", "--kv-cache-memory", "8MiB", "--max-model-len", "256"]


def test_generate_streams_text(tiny_llama_dir, capsys) -> None:
    rc = main(["generate", "--model", str(tiny_llama_dir), *ENGINE, "--max-tokens", "5",
               "--ignore-eos", "Hello world", "The fox"])
    assert rc == 0
    lines = capsys.readouterr().out.strip("\n").split("\n")
    assert len(lines) == 2 and all(lines)


def test_generate_reads_stdin(tiny_llama_dir, capsys, monkeypatch) -> None:
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("one prompt\n\nanother\n"))
    assert main(["generate", "--model", str(tiny_llama_dir), *ENGINE, "--max-tokens", "3",
                 "--ignore-eos"]) == 0
    assert len(capsys.readouterr().out.strip("\n").split("\n")) == 2


def test_chat_repl_keeps_the_conversation(tiny_llama_dir, capsys, monkeypatch) -> None:
    replies = iter(["hi there", "and again", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(replies))
    assert main(["chat", str(tiny_llama_dir), *ENGINE, "--max-tokens", "4", "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") >= 3  # banner + two streamed replies


def test_bench_throughput_reports_json(tiny_llama_dir, tmp_path, capsys) -> None:
    path = tmp_path / "r.json"
    assert main(["bench", "throughput", str(tiny_llama_dir), *ENGINE, "--num-prompts", "6",
                 "--input-len", "8-40", "--output-len", "4-8", "--output-json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["num_requests"] == 6
    assert 6 * 4 <= result["output_tokens"] <= 6 * 8
    assert result["total_tokens_per_s"] > 0
    assert "total tokens/s" in capsys.readouterr().out


def test_bad_flag_is_one_clear_line(tiny_llama_dir, capsys) -> None:
    assert main(["generate", "--model", str(tiny_llama_dir), "--dtype", "float32",
                 "--max-model-len", "100000", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --max-model-len 100000") and "Traceback" not in err


def test_unknown_subcommand_exits() -> None:
    with pytest.raises(SystemExit):
        main(["frobnicate"])
