"""The llama.cpp comparison's plain parts: the server's command line (slots, threads, a context that holds the
longest request), the request body, token counting from an answer, and the text-agreement measure. The bench
itself needs a llama-server binary and runs by hand (bench/llama_cpp.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.llama_cpp import add_arguments, common_prefix, completion_body, completion_tokens, server_command
from bench.throughput import BenchRequest

REQUESTS = [BenchRequest([5, 6, 7], 10), BenchRequest([5] * 20, 4)]


def test_server_command_matches_our_engine() -> None:
    command = server_command(Path("/bin/llama-server"), Path("m.gguf"), 8080, slots=4, threads=2, requests=REQUESTS)

    def option(name: str) -> str:
        return command[command.index(name) + 1]

    assert option("--parallel") == "4" and option("--threads") == option("--threads-batch") == "2"
    assert int(option("--ctx-size")) == 4 * (24 + 8)  # each slot holds the longest prompt + output
    assert "--cont-batching" in command and command[0] == "/bin/llama-server"


def test_body_and_token_count() -> None:
    assert completion_body(REQUESTS[0]) == {"prompt": [5, 6, 7], "max_tokens": 10, "temperature": 0.0,
                                            "ignore_eos": True}
    assert completion_tokens({"choices": [{"text": "x"}], "usage": {"completion_tokens": 10}}) == 10


def test_common_prefix_and_arguments() -> None:
    assert (common_prefix("abcd", "abxd"), common_prefix("ab", "abc"), common_prefix("", "a")) == (2, 2, 0)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--llama-server", "/x/llama-server"])
    assert args.quants == ["Q8_0", "Q4_K_M", "file"] and args.max_num_seqs == 16
