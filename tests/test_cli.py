"""The `djax` command: generation on the shipped demo model, options, batches, JSONL in and
out, resuming, signals, start-up imports, conversion, errors."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

import djax
from djax import prompt_io
from djax.cli import main

ROOT = Path(__file__).parents[1]


def cli_env() -> dict[str, str]:
    """The environment of a `python -m djax.cli` subprocess: this checkout first."""
    return os.environ | {"PYTHONPATH": str(ROOT)}


def test_generate_default_model(capsys):
    assert main(["generate", "--prompt", "12+345=", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["texts"] == ["357"] and "djax demo model" in result["model"]
    assert result["stats"]["forwards"] >= 1 and result["stats"]["tokens_per_forward"] > 1


def test_generate_options_reach_the_config(capsys, dense_folder):
    args = [
        "generate",
        "--model",
        str(dense_folder[0]),
        "--prompt",
        "12+34=",
        "--no-chat",
        "--gen-length",
        "16",
        "--block-length",
        "8",
        "--decoder",
        "low_confidence",
        "--steps",
        "8",
        "--cache",
        "none",
        "--no-early-stop",
        "--allow-pickle",
        "--json",
    ]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["stats"]["forwards"] == 8 and result["stats"]["refreshes"] == 8


def test_options_the_decoder_never_reads_are_refused_only_where_unread(tmp_path):
    """`--steps` with a decoder that commits by its own rule changes nothing under LLaDA and
    is refused naming it; under block diffusion every decoder splits steps over the blocks,
    so it passes there. Options left out, or read by the chosen decoder, always pass."""
    from djax.cli import _check_options_read, parse

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LLaDA2MoeModelLM"]}))
    args = parse(["generate", "--steps", "8"])
    config = djax.GenerationConfig(steps=8)
    _check_options_read(args, config, str(tmp_path))  # block diffusion reads it
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LLaDAModelLM"]}))
    with pytest.raises(ValueError, match="--steps 8 is read only by --decoder"):
        _check_options_read(args, config, str(tmp_path))
    fixed = parse(["generate", "--steps", "8", "--decoder", "random", "--threshold", "0.5"])
    with pytest.raises(ValueError, match="--threshold 0.5 is read only by"):
        _check_options_read(fixed, djax.GenerationConfig(decoder="random"), str(tmp_path))
    _check_options_read(parse(["generate"]), djax.GenerationConfig(), str(tmp_path))


def test_prompts_file_runs_in_batches(capsys, tmp_path):
    prompts = ["1+1=", "2+2=", "", "30+4=", "sort 3,1", "reverse abc"]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    args = ["generate", "--prompts-file", str(tmp_path / "p.txt"), "--batch-size", "2"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["texts"] == ["2", "4", "34", "1,3", "cba"]
    assert result["stats"]["batches"] == 3
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "> 30+4=\n34\n" in out and "3 batches: forwards" in out


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_in_and_out_resumes(capsys, tmp_path):
    inputs, outputs = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(
        inputs,
        [
            {"id": "add", "prompt": "12+345="},
            {"messages": [{"role": "user", "content": "sort 3,9,1"}]},
            {"id": 7, "prompt": "reverse abc\nreverse de"},  # a multi-line prompt
        ],
    )
    args = ["generate", "--input-jsonl", str(inputs), "--output-jsonl", str(outputs)]
    assert main([*args, "--batch-size", "2"]) == 0
    records = read_jsonl(outputs)
    assert [r["id"] for r in records] == ["add", 2, 7]
    assert records[0]["prompt"] == "12+345=" and records[0]["answer"] == "357"
    assert records[1]["messages"][0]["content"] == "sort 3,9,1"
    assert records[1]["answer"] == "1,3,9"
    assert records[2]["prompt"] == "reverse abc\nreverse de"
    assert records[0]["stats"]["forwards"] >= 1
    assert records[0]["token_ids"] and "wrote 3 answers" in capsys.readouterr().out

    # A second run with more prompts generates only the new ids, and says so.
    write_jsonl(
        inputs, [*map(json.loads, inputs.read_text().splitlines()), {"id": 9, "prompt": "1+2="}]
    )
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "already holds 3 of the 4 prompts; generating the other 1" in captured.err
    assert "wrote 1 answers" in captured.out
    records = read_jsonl(outputs)
    assert [r["id"] for r in records] == ["add", 2, 7, 9] and records[3]["answer"] == "3"


def test_lines_break_at_line_feeds_only(tmp_path):
    """A prompt holding a form feed, U+0085, U+2028 or U+2029 stays one prompt (with its id the
    line number), a JSONL record holding one raw stays readable, and an output file whose
    answers hold them (written raw: `ensure_ascii=False`) resumes."""
    odd = "a\x0cb\x85c\u2028d\u2029e"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"1+1=\r\n{odd}\n\n3+3=\n", encoding="utf-8")
    records = prompt_io.read_prompts_file(prompts)
    assert [(r.id, r.prompt) for r in records] == [(1, "1+1="), (2, odd), (4, "3+3=")]
    inputs = tmp_path / "in.jsonl"
    inputs.write_text(json.dumps({"id": "x", "prompt": odd}, ensure_ascii=False) + "\n")
    assert [(r.id, r.prompt) for r in prompt_io.read_jsonl(inputs)] == [("x", odd)]
    outputs = tmp_path / "out.jsonl"
    records = [
        {"id": "x", "prompt": odd, "answer": odd, "token_ids": [1]},
        {"id": 5, "prompt": "1+1=", "answer": "2", "token_ids": [2]},
    ]
    prompt_io.append_records(outputs, records)
    assert "c\u2028d\u2029e" in outputs.read_text(encoding="utf-8")  # raw, as JSON allows
    assert prompt_io.finished(outputs) == {"x": (odd, None), 5: ("1+1=", None)}


def test_a_lone_cr_stays_in_its_line_and_a_bom_is_dropped(tmp_path):
    """CR LF ends a line, a lone CR does not (the README's rule; universal newlines broke
    there and shifted every later id), and a UTF-8 byte-order mark is not part of prompt 1."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("\ufeff1+1=\r\na\rb\nc\n".encode())
    records = prompt_io.read_prompts_file(prompts)
    assert [(r.id, r.prompt) for r in records] == [(1, "1+1="), (2, "a\rb"), (3, "c")]


def test_resume_refuses_answers_generated_with_other_settings(tmp_path, capsys):
    """Each output record keeps what its answer was asked with (model, weights, dtype,
    chat, generation config); a run with other settings is refused naming what differs
    (it skipped the ids and kept the old answers as if they were the new settings'); the
    same settings resume; records without settings (older files) are taken as they are."""
    out = tmp_path / "out.jsonl"
    args = ["generate", "--prompt", "347+2958=", "--output-jsonl", str(out), "-q"]
    assert main(args) == 0
    (record,) = read_jsonl(out)
    settings = record["settings"]
    assert settings["model"] == str(djax.demo.default_model_path().resolve())
    assert settings["chat"] is True and settings["generation"]["gen_length"] == 32
    before = out.read_bytes()
    assert main([*args, "--gen-length", "16", "--temperature", "1.0"]) == 2
    err = capsys.readouterr().err
    assert "generated with other settings (gen_length 32 -> 16, " in err
    assert "temperature 0.0 -> 1.0" in err and out.read_bytes() == before
    assert main([*args, "--prompt", "1+1="]) == 0  # the same settings: id 1 is new
    assert [r["answer"] for r in read_jsonl(out)] == ["3305", "2"]
    del record["settings"]
    out.write_text(json.dumps(record) + "\n")
    assert main([*args, "--gen-length", "16"]) == 0  # an older record: nothing to compare


def test_resume_refuses_an_id_answered_for_another_prompt(tmp_path, capsys):
    """A prompts file's ids are its line numbers: a second file written to the same output
    is refused naming the id, where its prompts were skipped as answered."""
    a, b, out = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "out.jsonl"
    a.write_text("1+1=\n2+2=\n")
    b.write_text("5+5=\n6+6=\n")
    assert main(["generate", "--prompts-file", str(a), "--output-jsonl", str(out), "-q"]) == 0
    before = out.read_bytes()
    assert main(["generate", "--prompts-file", str(b), "--output-jsonl", str(out), "-q"]) == 2
    assert "holds an answer for id 1 to another prompt" in capsys.readouterr().err
    assert out.read_bytes() == before


@pytest.mark.parametrize(
    "line", ['{"id": 1, "prompt": "1+1="}', '{"id": 1, "answer": "2", "token_ids": [5]}']
)
def test_a_file_that_is_not_djax_output_is_never_appended_to(tmp_path, capsys, line):
    """A prompts JSONL (an id and a prompt, no answer) or a record without its prompt is not
    djax's output: refused, unchanged."""
    other = tmp_path / "other.jsonl"
    other.write_text(line + "\n")
    assert main(["generate", "--prompt", "2+2=", "--output-jsonl", str(other), "-q"]) == 2
    assert "not a djax output record" in capsys.readouterr().err
    assert other.read_text() == line + "\n"


def test_a_failed_append_is_cut_back_so_the_file_resumes(tmp_path, monkeypatch):
    """A write that fails halfway (a full disk) leaves the output as it was before it, so the
    next run resumes instead of refusing a cut line."""
    out = tmp_path / "out.jsonl"
    args = ["generate", "--prompt", "1+1=", "--output-jsonl", str(out), "-q"]
    write = prompt_io._write_all

    def half_then_full(fd, data):
        write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prompt_io, "_write_all", half_then_full)
    assert main(args) == 2
    assert out.read_bytes() == b""
    monkeypatch.undo()
    assert main(args) == 0
    assert [json.loads(x)["answer"] for x in out.read_text().splitlines()] == ["2"]


@pytest.mark.parametrize("where", ["jsonl", "argv"])
def test_a_lone_surrogate_is_refused_naming_where(tmp_path, capsys, where):
    """Text that is not valid Unicode (a JSON escape of a lone surrogate, or command-line
    bytes that are not UTF-8) is refused naming its line or --prompt, not by the tokenizer's
    TypeError."""
    if where == "jsonl":
        path = tmp_path / "in.jsonl"
        path.write_text('{"prompt": "1+1=\\ud800"}\n')
        assert main(["generate", "--input-jsonl", str(path), "-q"]) == 2
        assert f"{path}:1: character 4" in capsys.readouterr().err
    else:
        assert main(["generate", "--prompt", "1+1=\udcff", "-q"]) == 2
        assert "--prompt 0: character 4" in capsys.readouterr().err


@pytest.mark.parametrize(
    "record, where",
    [
        ('{"id": [1], "prompt": "1+1=", "answer": "2", "token_ids": [5]}', "out"),
        ('{"id": "a\\ud800", "prompt": "1+1=", "answer": "2", "token_ids": [5]}', "out"),
        ('{"id": "a\\ud800", "prompt": "1+1="}', "in"),
    ],
)
def test_a_bad_id_is_refused_naming_its_line_before_any_work(tmp_path, capsys, record, where):
    """An id that is not a string or an int (in the output file being resumed), or a string
    that is not valid Unicode (in either file), is refused naming the file and line before
    the model loads (it failed as a bare "unhashable type", or only when the answer was
    written)."""
    path = tmp_path / f"{where}.jsonl"
    path.write_text(record + "\n")
    out = path if where == "out" else tmp_path / "out.jsonl"
    source = ["--prompt", "1+1="] if where == "out" else ["--input-jsonl", str(path)]
    assert main(["generate", *source, "--output-jsonl", str(out)]) == 2
    captured = capsys.readouterr()
    assert f"{path}:1: id" in captured.err and "model:" not in captured.out
    assert path.read_text() == record + "\n"


@pytest.mark.parametrize("stdout", ["file", "pipe"])
def test_output_jsonl_refuses_the_run_s_own_stdout(tmp_path, stdout):
    """`--output-jsonl /dev/stdout` is refused before any work: redirected to a file, djax's
    own lines would overwrite the records; piped, reading it back to resume would hang."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DJAX_COMPILE_CACHE": str(tmp_path / "c")}
    command = [sys.executable, "-m", "djax.cli", "generate", "--prompt", "1+1="]
    command += ["--output-jsonl", "/dev/stdout"]
    if stdout == "file":
        with open(tmp_path / "out.txt", "w") as file:
            done = subprocess.run(
                command, stdout=file, stderr=subprocess.PIPE, env=env, text=True, timeout=120
            )
        expected = "is this run's standard output"
        assert (tmp_path / "out.txt").read_text() == ""
    else:
        done = subprocess.run(command, capture_output=True, env=env, text=True, timeout=120)
        expected = "is not a regular file"
    assert done.returncode == 2 and expected in done.stderr, done.stderr


def test_conversation_turns_as_the_server_takes_them(tmp_path):
    """A JSONL conversation's turns: text parts joined, `developer` given to the template as
    `system`; the answer's record holds the turns the template got."""
    inputs = tmp_path / "in.jsonl"
    turns = [
        {"role": "developer", "content": "answer briefly"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "1+"}, {"type": "text", "text": "1="}],
        },
    ]
    write_jsonl(inputs, [{"id": "c", "messages": turns}])
    (record,) = prompt_io.read_jsonl(inputs)
    assert record.prompt == [
        {"role": "system", "content": "answer briefly"},
        {"role": "user", "content": "1+1="},
    ]


def test_quiet_and_verbose(capsys, tmp_path):
    outputs = tmp_path / "out.jsonl"
    args = ["generate", "--prompt", "1+1=", "--output-jsonl", str(outputs)]
    assert main(args) == 0
    assert main([*args, "--quiet"]) == 0
    assert capsys.readouterr().err == ""  # the "already holds" warning is not shown
    assert main(["generate", "--prompt", "1+1=", "--verbose"]) == 0
    assert "batch of 1: forwards" in capsys.readouterr().err


def test_convert(capsys, dense_folder, tmp_path):
    out = tmp_path / "converted"
    assert main(["convert", str(dense_folder[0]), str(out), "--dtype", "float32"]) == 0
    assert djax.load(out).config == djax.load(dense_folder[0]).config
    assert main(["convert", str(dense_folder[0]), str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_generate_on_a_moe_folder(capsys, moe_folder):
    args = [
        "generate",
        "--model",
        str(moe_folder[0]),
        "--prompt",
        "sort 3,1",
        "--chat",
        "--gen-length",
        "16",
        "--block-length",
        "8",
        "--threshold",
        "0.5",
        "--json",
    ]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["stats"]["blocks"] >= 1 and len(result["texts"]) == 1


def test_converter_script(dense_folder, tmp_path, monkeypatch, capsys):
    """Run as a user runs it, then again in this process (as `__main__`) into the folder
    it filled: refused with status 2."""
    import runpy

    script = ROOT / "converters" / "hf_to_djax.py"
    out = tmp_path / "converted"
    run = subprocess.run(
        [sys.executable, str(script), str(dense_folder[0]), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert (out / "djax.json").is_file() and (out / "config.json").is_file()
    monkeypatch.setattr(sys, "argv", [str(script), str(dense_folder[0]), str(out)])
    with pytest.raises(SystemExit) as again:
        runpy.run_path(str(script), run_name="__main__")
    assert again.value.code == 2 and "is not empty" in capsys.readouterr().err


# What a `djax ...` run imported: it runs the CLI as `python -m djax.cli` does, then prints
# which of the heavy packages are in sys.modules.
IMPORTS = """
import runpy, sys
sys.argv = ["djax", *sys.argv[1:]]
try:
    runpy.run_module("djax.cli", run_name="__main__")
except SystemExit as exit:
    assert exit.code in (0, None), exit.code
print(sorted(m for m in ("jax", "torch", "transformers", "flax") if m in sys.modules))
"""


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"], ["--version"]])
def test_help_imports_no_jax_or_torch(args):
    run = subprocess.run(
        [sys.executable, "-c", IMPORTS, *args],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]"


def test_generate_does_not_import_torch():
    run = subprocess.run(
        [sys.executable, "-c", IMPORTS, "generate", "--prompt", "1+1="],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "['flax', 'jax', 'transformers']"


def test_version():
    run = subprocess.run(
        [sys.executable, "-m", "djax.cli", "--version"],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=60,
    )
    assert run.returncode == 0 and run.stdout.strip() == f"djax {djax.__version__}"
    assert djax.__version__ == metadata.version("djax")


@pytest.mark.parametrize(
    "argv, says",
    [
        (["generate", "--decoder", "foo"], "djax generate: error: argument --decoder: invalid"),
        (["convert", "a"], "djax convert: error: the following arguments are required: dst"),
        (["serve", "--port", "x"], "djax serve: error: argument --port: invalid int value"),
        (["nope"], "djax: error: argument COMMAND: invalid choice: 'nope'"),
    ],
)
def test_a_bad_option_is_one_line(capsys, argv, says):
    """argparse's refusals are one line on stderr, as djax's own errors, and exit 2."""
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith(says) and err.count("\n") == 1, err
    assert "--help lists the options" in err


def test_help_lists_choices_and_examples(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    assert "{auto,xla,cudnn,split_kv}" in text and "{none,prefix,dual,vicinity}" in text
    assert "(default: None)" not in text and "examples:" in text
    assert "--batch-size N" in text and "(default: 32)" in text


def test_a_stop_under_json_prints_the_finished_batches(capsys, monkeypatch):
    """A stop signal under `--json` prints the JSON of the batches that finished (with
    `"stopped"`) after the one stderr line, where it printed nothing: the answers on stdout
    are those of whole batches, as `--output-jsonl` keeps them."""
    import djax
    from djax import cli

    real, calls = djax.generate, []

    def stopped_at_the_second_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise cli.Stopped(signal.SIGINT)  # as the handler raises it mid-batch
        return real(*args, **kwargs)

    monkeypatch.setattr(djax, "generate", stopped_at_the_second_batch)
    argv = ["generate", "--prompt", "1+1=", "--prompt", "2+3=", "--prompt", "4+4="]
    assert main([*argv, "--batch-size", "2", "--json"]) == 130
    out, err = capsys.readouterr()
    assert err.strip() == "djax: stopped by SIGINT after 2 of 3 prompts"
    result = json.loads(out)
    assert result["stopped"] == "SIGINT" and result["prompts"] == ["1+1=", "2+3="]
    assert len(result["texts"]) == len(result["token_ids"]) == 2
    assert result["stats"]["batches"] == 1


# One signal a command: `main` stops generate and convert by the same handler for both,
# so SIGINT here and SIGTERM in test_files_and_faults' interrupted convert cover each.
@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130)])
def test_stop_signal_keeps_finished_batches(tmp_path, signum, status):
    """A stop signal during a long job ends it within a few seconds, with one line and no
    traceback, and the output file holds whole records of every finished batch."""
    prompts, outputs = tmp_path / "prompts.txt", tmp_path / "out.jsonl"
    prompts.write_text("".join(f"{i}+{i * 7}=\n" for i in range(20_000)))
    command = [sys.executable, "-m", "djax.cli", "generate", "--prompts-file", str(prompts)]
    command += ["--batch-size", "4", "--output-jsonl", str(outputs)]
    job = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env()
    )
    try:
        deadline = time.monotonic() + 120
        while not (outputs.exists() and outputs.stat().st_size) and job.poll() is None:
            assert time.monotonic() < deadline, "no batch finished in 120 s"
            time.sleep(0.1)
        sent = time.monotonic()
        job.send_signal(signum)
        _, err = job.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        job.kill()
    assert job.returncode == status, err
    assert took < 5 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    records = read_jsonl(outputs)
    name = signal.Signals(signum).name
    assert f"stopped by {name} after {len(records)} of 20000 prompts" in err
    assert f"{len(records)} answers written" in err
    assert 0 < len(records) < 20_000 and len(records) % 4 == 0
    assert [r["id"] for r in records] == list(range(1, len(records) + 1))
    assert records[0]["answer"] == "0"


def readme_blocks(section: str, language: str) -> list[str]:
    """The fenced `language` blocks of the README section headed `## {section}`."""
    text = (ROOT / "README.md").read_text().split(f"\n## {section}\n", 1)[1].split("\n## ")[0]
    return [block.split("```")[0] for block in text.split(f"```{language}\n")[1:]]


def test_readme_cli_examples(tmp_path):
    """The README's demo examples run as written, in a shell (the prompts files they write
    first, the conversion of the demo model and generating from its folder included)."""
    block = readme_blocks("The CLI", "bash")[1]
    assert block.count("djax generate") == 5 and "djax convert" in block
    shims = f'djax() {{ "{sys.executable}" -m djax.cli "$@"; }}\n'
    shims += f'python() {{ "{sys.executable}" "$@"; }}\nset -e\n'
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DJAX_COMPILE_CACHE": str(tmp_path / "c")}
    done = subprocess.run(
        ["bash", "-c", shims + block], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    answers = [r["answer"] for r in read_jsonl(tmp_path / "answers.jsonl")]
    assert answers == ["357", "1,3,9"]
    # the first example's answer and the converted folder's, each a line of its own (a
    # stats line's figures may hold the digits too)
    assert done.stdout.splitlines().count("3305") == 2
    assert (tmp_path / "demo-djax" / "djax.json").is_file()


def test_readme_demo_python_example(capsys):
    (example,) = readme_blocks("The Python API", "python")
    exec(compile(example, "README.md", "exec"), {})
    assert capsys.readouterr().out.startswith("['3305', '1,3,9']")


@pytest.mark.parametrize("command", ["generate", "serve", "convert"])
def test_an_unknown_option_is_refused_by_its_command(command, capsys):
    """A misspelt option is refused by the command's own parser, whose --help lists the
    options (the top level's, `djax --help`, named none of them)."""
    folders = ["src", "dst"] if command == "convert" else []
    with pytest.raises(SystemExit) as exited:
        main([command, *folders, "--gen-lenght=8"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"djax {command}: error: unrecognized arguments: --gen-lenght=8" in err
    assert f"(djax {command} --help lists the options)" in err
