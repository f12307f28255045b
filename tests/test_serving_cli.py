"""`djax serve`: its options, and a served process that drains and exits 0 on a signal."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from djax import cli as djax_cli
from djax.cli import build_parser
from djax.serving import cli, memory

TESTS = Path(__file__).parent
ROOT = TESTS.parent


def parse(argv):
    return build_parser().parse_args(["serve", *argv])


@pytest.fixture
def served(monkeypatch):
    """What `run` hands `serve`, which is not run."""
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
        "api_key": None,
    }


def test_options_reach_the_config(served):
    argv = "--gen-length 16 --threshold 0.7 --temperature 0.5 --scheduler static --max-batch 4"
    argv += " --max-queue 9 --max-seq-len 96 --served-model-name tiny --port 0 --log-level debug"
    argv += " --memory-fraction 0.5"
    assert cli.run(parse(argv.split())) == 0
    ((_, config, kw),) = served
    assert (config.memory_fraction, config.memory_bytes) == (0.5, None)
    g = config.generation
    assert (g.gen_length, g.block_length, g.threshold, g.temperature) == (16, 8, 0.7, 0.5)
    assert (config.scheduler, config.max_batch, config.max_queue, config.max_seq_len) == (
        "static",
        4,
        9,
        96,
    )
    assert (kw["model_name"], kw["port"], kw["log_level"]) == ("tiny", 0, "debug")


def test_the_api_key_comes_from_the_option_or_the_environment(served, monkeypatch, capsys):
    monkeypatch.setenv("DJAX_API_KEY", "from-env")
    assert cli.run(parse([])) == 0
    assert cli.run(parse(["--api-key", "from-option"])) == 0
    assert [kw["api_key"] for _, _, kw in served] == ["from-env", "from-option"]
    monkeypatch.delenv("DJAX_API_KEY")
    assert cli.run(parse([])) == 0 and served[-1][2]["api_key"] is None


def test_bad_memory_fraction_is_refused(served, capsys):
    for value in ("0", "-0.5", "1.5", "nan"):
        assert cli.run(parse(["--memory-fraction", value, "--port", "0"])) == 2
        err = capsys.readouterr().err
        assert f"memory_fraction={float(value)}; expected a number in (0, 1]" in err
    with pytest.raises(SystemExit):
        parse(["--memory-fraction", "most"])
    assert "invalid float value: 'most'" in capsys.readouterr().err
    assert not served


def test_jax_gets_most_of_each_gpu_before_loading_unless_the_environment_says(served, monkeypatch):
    for name in memory.POOL_VARIABLES:
        monkeypatch.setenv(name, "")  # unset for JAX; restored after the test
    seen = []
    load = djax_cli._load
    monkeypatch.setattr(
        djax_cli,
        "_load",
        lambda *a, **k: seen.append(os.environ[memory.POOL_VARIABLES[0]]) or load(*a, **k),
    )
    assert cli.run(parse(["--port", "0"])) == 0
    assert seen == [str(memory.POOL_FRACTION)] and memory.POOL_FRACTION == 0.95
    # A fraction the environment sets, under either name, is left as it is.
    for name in memory.POOL_VARIABLES:
        environ = {name: "0.5"}
        assert memory.size_device_pool(environ) is None and environ == {name: "0.5"}
    environ = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert memory.size_device_pool(environ) == "XLA_CLIENT_MEM_FRACTION"
    assert environ["XLA_CLIENT_MEM_FRACTION"] == "0.95"


def test_user_errors_exit_2(served, capsys, tmp_path):
    assert cli.run(parse(["--model", str(tmp_path / "missing")])) == 2
    assert "missing" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.run(parse(["--port", str(port)])) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    for port in ("-1", "70000"):
        assert cli.run(parse(["--port", port])) == 2
        assert f"port={port}; expected 0 to 65535" in capsys.readouterr().err
    assert served == []
    for scheduler in ("dynamic", "auto"):
        with pytest.raises(SystemExit):
            parse(["--scheduler", scheduler])


def test_a_bad_compile_cache_setting_fails_before_the_load_and_the_socket(
    served, capsys, tmp_path, monkeypatch
):
    """`djax serve` turns the compile cache on before it loads the model (whose programs
    then use it): a malformed cache size fails at once, exit 2, nothing loaded; `serve`
    itself fails (building its engine) before it opens its socket."""
    import djax
    from djax import demo
    from djax.serving import server
    from djax.serving.engine import ServeConfig, ServingEngine

    monkeypatch.setenv("DJAX_COMPILE_CACHE", str(tmp_path / "xla"))
    monkeypatch.setenv("DJAX_COMPILE_CACHE_MAX_SIZE", "lots")

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(djax_cli, "_load", load)
    assert cli.run(parse([])) == 2
    assert "DJAX_COMPILE_CACHE_MAX_SIZE" in capsys.readouterr().err
    assert served == []
    model = djax.load(demo.default_model_path())
    config = ServeConfig(djax.GenerationConfig(**demo.generation_defaults()))
    port = free_port()
    monkeypatch.undo()  # the real serve again, the bad size still set
    monkeypatch.setenv("DJAX_COMPILE_CACHE", str(tmp_path / "xla"))
    monkeypatch.setenv("DJAX_COMPILE_CACHE_MAX_SIZE", "lots")

    def start(self):
        raise AssertionError("the engine started")

    monkeypatch.setattr(ServingEngine, "start", start)  # a failure, not a server, if late
    with pytest.raises(ValueError, match="DJAX_COMPILE_CACHE_MAX_SIZE"):
        server.serve(model, config, port=port)
    with socket.socket() as again:  # no socket of serve's is left listening on the port
        again.bind(("127.0.0.1", port))


def test_vllm_s_option_names_are_the_same_options():
    """`--max-num-seqs`, `--max-model-len` and `--tensor-parallel-size` (vLLM's names) set
    what `--max-batch`, `--max-seq-len` and `--tensor-parallel` set."""
    parser = build_parser()
    ours = parser.parse_args(
        ["serve", "--max-batch", "4", "--max-seq-len", "96", "--tensor-parallel", "2"]
    )
    vllm = parser.parse_args(
        ["serve", "--max-num-seqs", "4", "--max-model-len", "96", "--tensor-parallel-size", "2"]
    )
    assert vars(ours) == vars(vllm)
    assert (vllm.max_batch, vllm.max_seq_len, vllm.tensor_parallel) == (4, 96, 2)


@pytest.mark.parametrize(
    "flag, choices, field",
    [
        ("--scheduler", "SCHEDULERS", "scheduler"),
        ("--scheduling-policy", "SCHEDULING_POLICIES", "scheduling_policy"),
    ],
)
def test_the_scheduler_choices_are_the_engines(flag, choices, field):
    """The options list the engine's schedulers and scheduling policies (written out, so
    `djax --help` imports no jax), the engine's default first."""
    from djax.serving import engine
    from djax.serving.engine import ServeConfig

    (action,) = [
        a
        for command in build_parser()._subparsers._group_actions[0].choices.values()
        for a in command._actions
        if flag in a.option_strings
    ]
    assert tuple(action.choices) == getattr(engine, choices)
    assert action.default == getattr(ServeConfig(), field)


# The demo model on one row, greedy only, sequences up to 64: one program to compile.
SERVE = "serve --max-batch 1 --no-sampling --max-seq-len 64 --log-level warning --port"


# SIGINT (Ctrl-C, as the README stops it) and SIGTERM (what a supervisor sends).
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_drains_the_requests_in_flight_and_exits_0(sig):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "djax.cli", *SERVE.split(), str(port)],
        cwd=ROOT,
        env={
            "PYTHONPATH": str(ROOT),
            "PATH": "/usr/bin:/bin",
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),  # conftest.py's quick CPU compile
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
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
        body = {  # three blocks: the answer, then end-of-text tokens (not text)
            "messages": [{"role": "user", "content": "347+2958="}],
            "stream": True,
            "max_tokens": 24,
            "ignore_eos": True,
        }
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
            stream = response.iter_lines()
            first = next(stream)
            process.send_signal(sig)  # after the first block: the answer still completes
            lines = [first, *(line for line in stream if line)]
        chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == "3305"
        assert lines[-1] == "data: [DONE]"
        _, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0, err
    assert "Traceback" not in err


def test_a_failed_engine_ends_the_server(monkeypatch):
    """An engine whose warm-up fails ends `serve` (RuntimeError naming why), so `djax serve`
    exits 1 instead of answering 503 for ever."""
    import djax
    from djax import demo
    from djax.serving.engine import ServeConfig, ServingEngine
    from djax.serving.server import serve

    def fail(self):
        raise OverflowError("a warm-up that cannot finish")

    monkeypatch.setattr(ServingEngine, "_warm_up", fail)
    model = djax.load(demo.default_model_path())
    config = ServeConfig(djax.GenerationConfig(**demo.generation_defaults()))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the engine stopped: a warm-up that cannot finish"):
        serve(model, config, port=0, log_level="warning")
    assert time.monotonic() - start < 30
