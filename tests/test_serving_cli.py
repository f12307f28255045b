"""`djax serve`: its options, and a served process that drains and exits 0 on a signal."""

import argparse
import importlib.util
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from djax.serving import cli

TESTS = Path(__file__).parent
ROOT = TESTS.parent


def parse(argv):
    parser = argparse.ArgumentParser(prog="djax")
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


@pytest.fixture
def served(monkeypatch):
    """What `run` hands `serve`, which is not run; a stand-in engine module when the real
    one is missing."""
    if importlib.util.find_spec("djax.serving.engine") is None:
        import serving_fakes

        monkeypatch.setitem(sys.modules, "djax.serving.engine", serving_fakes.engine_module(None))
    calls = []
    monkeypatch.setattr(
        "djax.serving.server.serve", lambda model, config, **kw: calls.append((model, config, kw))
    )
    return calls


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_demo_model_with_its_generation_defaults(served):
    assert cli.run(parse([])) == 0
    ((model, config, kw),) = served
    assert model.config.max_seq_len == 128 and model.tokenizer is not None
    assert (config.generation.gen_length, config.generation.block_length) == (32, 8)
    assert (config.scheduler, config.max_batch, config.max_queue, config.max_seq_len) == (
        "continuous",
        32,
        1024,
        None,
    )
    assert kw == {
        "host": "127.0.0.1",
        "port": 8000,
        "model_name": "djax-demo",
        "log_level": "info",
    }


def test_options_reach_the_config(served):
    argv = "--gen-length 16 --threshold 0.7 --temperature 0.5 --scheduler static --max-batch 4"
    argv += " --max-queue 9 --max-seq-len 96 --served-model-name tiny --port 0 --log-level debug"
    assert cli.run(parse(argv.split())) == 0
    ((_, config, kw),) = served
    g = config.generation
    assert (g.gen_length, g.block_length, g.threshold, g.temperature) == (16, 8, 0.7, 0.5)
    assert (config.scheduler, config.max_batch, config.max_queue, config.max_seq_len) == (
        "static",
        4,
        9,
        96,
    )
    assert (kw["model_name"], kw["port"], kw["log_level"]) == ("tiny", 0, "debug")


def test_user_errors_exit_2(served, capsys, tmp_path):
    assert cli.run(parse(["--model", str(tmp_path / "missing")])) == 2
    assert "missing" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.run(parse(["--port", str(port)])) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert served == []
    with pytest.raises(SystemExit):
        parse(["--scheduler", "dynamic"])


SERVE = """
import argparse, sys
sys.path.insert(0, {tests!r})
import serving_fakes
from djax.serving import cli

def make_engine(model, config, metrics):
    engine = serving_fakes.FakeEngine(config, serving_fakes.scripted(model.tokenizer, "x" * 64))
    engine.interval = 0.1
    return engine

sys.modules["djax.serving.engine"] = serving_fakes.engine_module(make_engine)
parser = argparse.ArgumentParser()
cli.add_parser(parser.add_subparsers())
sys.exit(cli.run(parser.parse_args(["serve", "--port", "{port}", "--log-level", "warning"])))
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_drains_the_requests_in_flight_and_exits_0(sig):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-c", SERVE.format(tests=str(TESTS), port=port)],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the server did not become ready"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "djax-demo"
        body = {"prompt": "347+2958=", "stream": True}  # 32 tokens (the demo's gen_length)
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as response:
            stream = response.iter_lines()
            first = next(stream)
            process.send_signal(sig)  # after the first block: the answer still completes
            lines = [first, *(line for line in stream if line)]
        chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == "x" * 32
        assert lines[-1] == "data: [DONE]"
        _, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0, err
    assert "Traceback" not in err
