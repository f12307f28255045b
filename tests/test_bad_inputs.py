"""Bad inputs, table-driven: each CLI row is `djax` arguments with the exit status and a
fragment of the one-line message on stderr (never a traceback); each API row is a call with
the exception it raises and a fragment of its message."""

import copy
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import djax
from djax import demo
from djax.cli import main

DEMO = str(demo.default_model_path())


def files(tmp: Path) -> dict[str, str]:
    """Bad input files, by name, written under `tmp`."""
    contents = {
        "empty.txt": "\n  \n",
        "not_json.jsonl": '{"prompt": "1+1="}\n{oops\n',
        "no_prompt.jsonl": '{"id": 1, "text": "1+1="}\n',
        "both.jsonl": '{"prompt": "1+1=", "messages": []}\n',
        "empty_prompt.jsonl": '{"prompt": ""}\n',
        "bad_messages.jsonl": '{"messages": [{"content": "hi"}]}\n',
        "repeated.jsonl": '{"id": "a", "prompt": "1+1="}\n{"id": "a", "prompt": "2+2="}\n',
        "bool_id.jsonl": '{"id": true, "prompt": "1+1="}\n',
        "empty.jsonl": "\n",
        "not_ours.jsonl": "some notes\n",
        "cut_short.jsonl": '{"id": 0, "answer": "2"}\n{"id": 1, "ans',
        "good.jsonl": '{"id": "a", "prompt": "1+1="}\n',
        "record_options.jsonl": '{"prompt": "1+1=", "source": "gsm8k"}\n'
        '{"prompt": "2+2=", "temperature": 1.0}\n',
        "null_content.jsonl": '{"messages": [{"role": "user", "content": null}]}\n',
        "tool_role.jsonl": '{"messages": [{"role": "tool", "content": "4"}]}\n',
        "part_list.jsonl": '{"messages": [{"role": "user", "content": [{"text": "1+1="}]}]}\n',
        "mask_line.txt": "1+1=\n2+2=\n3+<|mdm_mask|>=\n",
        "long_line.txt": "1+1=\n" + "9" * 300 + "\n",
    }
    for name, text in contents.items():
        (tmp / name).write_text(text)
    (tmp / "binary.txt").write_bytes(b"1+1=\n\xe7\x00\xff\n")
    names = [*contents, "binary.txt"]
    paths = {name: str(tmp / name) for name in names}
    return paths | {"no_folder/out.jsonl": str(tmp / "no_folder" / "out.jsonl")}


GEN = ["generate", "--prompt", "1+1="]

# (arguments with {file} placeholders, environment, exit status, message fragment)
CLI_ROWS = [
    (["generate", "--decoder", "greedy"], {}, 2, "invalid choice: 'greedy'"),
    (["generate", "--cache", "paged"], {}, 2, "invalid choice: 'paged'"),
    (["generate", "--attention-impl", "fast"], {}, 2, "invalid choice: 'fast'"),
    (["generate", "--norm-impl", "fast"], {}, 2, "invalid choice: 'fast'"),
    (["generate", "--moe-impl", "fast"], {}, 2, "invalid choice: 'fast'"),
    (["generate", "--dtype", "float8"], {}, 2, "invalid choice: 'float8'"),
    (["convert", "a", "b", "--dtype", "int8"], {}, 2, "invalid choice: 'int8'"),
    (["generate", "--seed", "99999999999999999999"], {}, 2, "seed=99999999999999999999; expected"),
    (["generate", "--seed", "-1"], {}, 2, "seed=-1; expected an int in [0, 2**32)"),
    (["generate", "--seed", "1.5"], {}, 2, "invalid int value: '1.5'"),
    ([*GEN, "--stop-ids", "99999"], {}, 2, "stop_ids [99999] outside the model's vocabulary"),
    ([*GEN, "--stop-ids", "1,x"], {}, 2, "'1,x' is not a comma-separated list of ids"),
    ([*GEN, "--stop-ids", "-3"], {}, 2, "stop_ids=(-3,); expected a tuple of token ids"),
    ([*GEN, "--temperature", "inf"], {}, 2, "temperature=inf; expected a finite number ≥ 0"),
    ([*GEN, "--temperature", "nan"], {}, 2, "temperature=nan; expected a finite number ≥ 0"),
    ([*GEN, "--temperature", "-0.5"], {}, 2, "temperature=-0.5; expected a finite number"),
    ([*GEN, "--top-p", "0"], {}, 2, "top_p=0.0; expected a number in (0, 1]"),
    ([*GEN, "--threshold", "nan"], {}, 2, "threshold=nan; expected a finite number"),
    ([*GEN, "--gen-length", "0"], {}, 2, "gen_length=0; expected a positive int"),
    ([*GEN, "--refresh-every", "99999999999"], {}, 2, "refresh_every=99999999999; expected"),
    ([*GEN, "--attention-sparsity", "0"], {}, 2, "attention_sparsity=0.0; expected the fraction"),
    ([*GEN, "--attention-sparsity", "0.5", "--cache", "none"], {}, 2, "cache='none' has none"),
    ([*GEN, "--gen-length", "256"], {}, 2, "exceeds the model's maximum sequence length 128"),
    ([*GEN, "--batch-size", "0"], {}, 2, "'0' is not a positive int"),
    ([*GEN, "--steps", "8"], {}, 2, "--steps 8 is read only by --decoder low_confidence|random"),
    (
        [*GEN, "--decoder", "low_confidence", "--threshold", "0.5"],
        {},
        2,
        "--threshold 0.5 is read only by --decoder threshold|credit|hierarchy; --decoder "
        "low_confidence never reads it",
    ),
    ([*GEN, "--factor", "2"], {}, 2, "--decoder threshold never reads it"),
    ([*GEN, "--vicinity-before", "4"], {}, 2, "--cache dual never reads it"),
    (["generate", "--prompt", "1+1=", "--prompt", ""], {}, 2, "--prompt 1 is empty; expected"),
    ([*GEN, "--tensor-parallel", "-2"], {}, 2, "'-2' is not a positive int"),
    ([*GEN, "--model", "{missing}"], {}, 2, "is not a folder"),
    ([*GEN, "--prompts-file", "x"], {}, 2, "not allowed with argument --prompt"),
    ([*GEN, "--json", "--output-jsonl", "x"], {}, 2, "not allowed with argument --json"),
    (["generate", "--prompts-file", "{empty.txt}"], {}, 2, "holds no prompts"),
    (["generate", "--prompts-file", "{missing}"], {}, 2, "--prompts-file {missing}: No such file"),
    (["generate", "--input-jsonl", "{missing}"], {}, 2, "--input-jsonl {missing}: No such file"),
    (["generate", "--input-jsonl", "{not_json.jsonl}"], {}, 2, "not_json.jsonl:2: not JSON"),
    (["generate", "--input-jsonl", "{no_prompt.jsonl}"], {}, 2, 'with "prompt" or "messages"'),
    (["generate", "--input-jsonl", "{both.jsonl}"], {}, 2, 'with "prompt" or "messages"'),
    (["generate", "--input-jsonl", "{empty_prompt.jsonl}"], {}, 2, "must be a non-empty string"),
    (["generate", "--input-jsonl", "{bad_messages.jsonl}"], {}, 2, "[0] has role None; expected"),
    (
        ["generate", "--input-jsonl", "{null_content.jsonl}"],
        {},
        2,
        "null_content.jsonl:1: messages[0] has content None; expected a string or a list of text",
    ),
    (["generate", "--input-jsonl", "{tool_role.jsonl}"], {}, 2, "messages[0] has role 'tool'"),
    (["generate", "--input-jsonl", "{part_list.jsonl}"], {}, 2, "[0] has content [{'text'"),
    (
        ["generate", "--prompts-file", "{mask_line.txt}", "--batch-size", "2"],
        {},
        2,
        "prompt id 3 contains the mask id 2 at position",
    ),
    (
        ["generate", "--prompts-file", "{long_line.txt}", "--explain"],
        {},
        2,
        "prompt id 2 (",
    ),
    (["generate", "--input-jsonl", "{repeated.jsonl}"], {}, 2, "id 'a' repeats"),
    (["generate", "--input-jsonl", "{bool_id.jsonl}"], {}, 2, "id True; expected a string"),
    (["generate", "--input-jsonl", "{empty.jsonl}"], {}, 2, "holds no records"),
    (
        ["generate", "--input-jsonl", "{record_options.jsonl}"],
        {},
        2,
        'record_options.jsonl:2: holds "temperature", a generation option; every record runs',
    ),
    ([*GEN, "--output-jsonl", "{not_ours.jsonl}"], {}, 2, "not_ours.jsonl:1: not a djax output"),
    ([*GEN, "--output-jsonl", "{cut_short.jsonl}"], {}, 2, "the last line is cut short"),
    (["generate", "--prompts-file", "{binary.txt}"], {}, 2, "binary.txt: byte 5 is not UTF-8"),
    (["generate", "--input-jsonl", "{binary.txt}"], {}, 2, "binary.txt: byte 5 is not UTF-8"),
    ([*GEN, "--output-jsonl", "{binary.txt}"], {}, 2, "binary.txt: byte 5 is not UTF-8"),
    ([*GEN, "--output-jsonl", "{no_folder/out.jsonl}"], {}, 2, "no_folder' does not exist"),
    (
        ["generate", "--input-jsonl", "{good.jsonl}", "--output-jsonl", "{good.jsonl}"],
        {},
        2,
        "is the prompts' own file; expected another file",
    ),
    (
        GEN,
        {"DJAX_XLA_OPTIONS": "xla_no_such_option=1"},
        2,
        "DJAX_XLA_OPTIONS: No such compile option: 'xla_no_such_option'",
    ),
    (GEN, {"DJAX_XLA_OPTIONS": "gpu_thing=1"}, 2, "'gpu_thing=1' is not name=value"),
]


def row_id(row) -> str:
    args, env, _, _ = row
    return " ".join([*(f"{k}=.." for k in env), *args])[:60]


@pytest.mark.parametrize("args, env, status, message", CLI_ROWS, ids=map(row_id, CLI_ROWS))
def test_cli_rejects(args, env, status, message, tmp_path, capsys, monkeypatch):
    paths = files(tmp_path) | {"missing": str(tmp_path / "missing")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        code = main([paths[a[1:-1]] if a.startswith("{") else a for a in args])
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    err = capsys.readouterr().err
    for name, path in paths.items():  # a file's placeholder in the message: its path
        message = message.replace("{" + name + "}", path)
    assert code == status
    assert message in err and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("djax")]
    assert len(lines) == 1, err  # one line (argparse adds its usage before it)


def test_cli_rejects_in_a_fresh_process():
    """The issue's case as a user meets it: an overflowing seed is one line, no traceback."""
    run = subprocess.run(
        [sys.executable, "-m", "djax.cli", "generate", "--seed", "99999999999999999999"],
        capture_output=True,
        text=True,
        env=os.environ | {"PYTHONPATH": str(Path(__file__).parents[1])},
        timeout=120,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip() == (
        "djax: error: seed=99999999999999999999; expected an int in [0, 2**32)"
    )


@pytest.fixture(scope="module")
def demo_model():
    return djax.load(DEMO)


SMALL = {"gen_length": 8, "block_length": 8}


def refusing_template(model):
    """`model` with a chat template that raises (as templates do on a turn they refuse)."""
    tokenizer = copy.deepcopy(model.tokenizer)
    tokenizer.chat_template = "{{ raise_exception('no such turn') }}"
    return dataclasses.replace(model, tokenizer=tokenizer)


# (call taking the demo model, exception type, message fragment)
API_ROWS = [
    (
        lambda m: djax.generate(
            refusing_template(m),
            ["1+1=", [{"role": "user", "content": "2+2="}]],
            djax.GenerationConfig(**SMALL),
        ),
        ValueError,
        "prompt 1 is refused by the chat template (TemplateError: no such turn)",
    ),
    (
        lambda m: djax.load(DEMO, atention_impl="xla"),
        TypeError,
        "unknown kernel option 'atention_impl'; did you mean 'attention_impl'?",
    ),
    (lambda m: djax.load(DEMO, kernels="fast"), TypeError, "expected one of ('attention_impl'"),
    (lambda m: djax.load(DEMO, attention_impl="fast"), ValueError, "attention_impl='fast'"),
    (lambda m: djax.load(DEMO, moe_impl="sparse"), ValueError, "moe_impl='sparse'; expected"),
    (lambda m: djax.load(DEMO, norm_impl=None), ValueError, "norm_impl=None; expected one of"),
    (lambda m: m.with_options(mlp_imp="xla"), TypeError, "did you mean 'mlp_impl'?"),
    (lambda m: m.with_options(rope_impl="triton"), ValueError, "rope_impl='triton'"),
    (lambda m: djax.load("/no/such/folder"), FileNotFoundError, "is not a folder"),
    (lambda m: djax.load(DEMO, mesh="cpu"), TypeError, "mesh='cpu'; expected a jax.sharding"),
    (lambda m: djax.GenerationConfig(seed=2**32), ValueError, "seed=4294967296; expected"),
    (lambda m: djax.GenerationConfig(seed=-1), ValueError, "seed=-1; expected"),
    (lambda m: djax.GenerationConfig(smoothing="no"), ValueError, "smoothing='no'; expected True"),
    (lambda m: djax.GenerationConfig(early_stop="false"), ValueError, "early_stop='false'"),
    (lambda m: djax.GenerationConfig(vicinity_before=2.5), ValueError, "vicinity_before=2.5"),
    (lambda m: djax.GenerationConfig(threshold=True), ValueError, "threshold=True; expected"),
    (lambda m: djax.GenerationConfig(temperature=True), ValueError, "temperature=True"),
    (
        lambda m: djax.GenerationConfig(refresh_every=2**31),
        ValueError,
        "refresh_every=2147483648; expected an int below 2**31",
    ),
    (
        lambda m: djax.GenerationConfig(cache="vicinity", vicinity_before=10**11),
        ValueError,
        "vicinity_before=100000000000; expected an int below",
    ),
    (lambda m: djax.GenerationConfig(seed=True), ValueError, "seed=True; expected"),
    (lambda m: djax.GenerationConfig(temperature=float("inf")), ValueError, "temperature=inf"),
    (lambda m: djax.GenerationConfig(temperature=float("nan")), ValueError, "temperature=nan"),
    (lambda m: djax.GenerationConfig(temperature=-1e-3), ValueError, "temperature=-0.001"),
    (lambda m: djax.GenerationConfig(top_k=-1), ValueError, "top_k=-1; expected an int ≥ 0"),
    (lambda m: djax.GenerationConfig(top_k=2.0), ValueError, "top_k=2.0; expected an int"),
    (lambda m: djax.GenerationConfig(top_p=0), ValueError, "top_p=0; expected a number in (0, 1]"),
    (lambda m: djax.GenerationConfig(top_p=1.5), ValueError, "top_p=1.5; expected a number in"),
    (
        lambda m: djax.GenerationConfig(temperature=1.0, top_p=0.9, logits_chunk=64),
        ValueError,
        "top_k=0, top_p=0.9 need a step's whole logits; logits_chunk=64",
    ),
    (lambda m: djax.GenerationConfig(factor=float("inf")), ValueError, "factor=inf"),
    (lambda m: djax.GenerationConfig(stop_ids=[1]), ValueError, "stop_ids=[1]; expected a tuple"),
    (lambda m: djax.GenerationConfig(stop_ids=(1, -1)), ValueError, "stop_ids=(1, -1)"),
    (lambda m: djax.GenerationConfig(gen_length=8.0), ValueError, "gen_length=8.0; expected"),
    (
        lambda m: djax.generate(m, ["1+1="], djax.GenerationConfig(**SMALL, stop_ids=(1, 128))),
        ValueError,
        "stop_ids [128] outside the model's vocabulary [0, 128)",
    ),
    (
        lambda m: djax.generate(m, [[{"role": "user"}]], djax.GenerationConfig(**SMALL)),
        TypeError,
        "prompt 0 is [{'role': 'user'}]; expected a string, a list of token ids (ints) or",
    ),
    (
        lambda m: djax.generate(m, ["1+1=", [5, 6]], djax.GenerationConfig(**SMALL), chat=True),
        ValueError,
        "prompt 1 is token ids; chat=True takes strings or messages",
    ),
    (
        lambda m: djax.generate(m, ["1+1="], {"gen_length": 8}),
        TypeError,
        "config is a dict; expected a djax.GenerationConfig",
    ),
    # one prompt's ids without their own list; bytes; booleans (once taken as ids 1 and 0)
    (
        lambda m: djax.generate(m, [62, 63, 66], djax.GenerationConfig(**SMALL)),
        TypeError,
        "prompt 0 is 62; expected a string, a list of token ids",
    ),
    (
        lambda m: djax.generate(m, [b"1+1="], djax.GenerationConfig(**SMALL)),
        TypeError,
        "prompt 0 is b'1+1='; expected",
    ),
    (
        lambda m: djax.generate(m, [[True, False, 5]], djax.GenerationConfig(**SMALL)),
        TypeError,
        "prompt 0 is [True, False, 5]; expected",
    ),
    (
        lambda m: djax.generate(
            m, ["1+1="], djax.GenerationConfig(**SMALL, stop_ids=(m.config.mask_token_id,))
        ),
        ValueError,
        "stop_ids holds the mask id",
    ),
    (
        lambda m: djax.load(DEMO, dtype=jnp.int32),
        ValueError,
        "; expected one of float32, bfloat16, float16",
    ),
    (
        lambda m: djax.load(DEMO, dtype=jnp.float8_e4m3fn),
        ValueError,
        "; expected one of float32, bfloat16, float16",
    ),
    (lambda m: djax.load(DEMO, dtype="fast"), ValueError, "dtype='fast'; expected one of"),
    (
        lambda m: djax.forward_logits(m, np.zeros((1, 0), np.int32)),
        ValueError,
        "token_ids has shape (1, 0) and dtype int32; expected [batch, seq] integers, at least",
    ),
    (
        lambda m: djax.forward_logits(m, np.full((1, m.config.max_seq_len + 1), 5)),
        ValueError,
        "expected at most the model's maximum sequence length",
    ),
]


def test_numpy_scalars_in_a_generation_config():
    """numpy scalars (as prompts' ids may be) are taken as the Python values they hold."""
    config = djax.GenerationConfig(
        seed=np.int64(3),
        gen_length=np.int64(16),
        threshold=np.float32(0.5),
        stop_ids=(np.int64(5),),
    )
    assert (config.seed, config.gen_length, config.threshold, config.stop_ids) == (3, 16, 0.5, (5,))
    assert type(config.seed) is int and type(config.stop_ids[0]) is int
    with pytest.raises(ValueError, match="seed=True"):
        djax.GenerationConfig(seed=np.bool_(True))
    for bad in (True, None, "0.8", float("nan")):  # checked as the other numbers are
        with pytest.raises(ValueError, match=r"credit_beta=.*; expected a finite number"):
            djax.GenerationConfig(credit_beta=bad)


@pytest.mark.parametrize("call, error, message", API_ROWS)
def test_api_rejects(demo_model, call, error, message):
    with pytest.raises(error) as raised:
        call(demo_model)
    assert message in str(raised.value)


def test_unknown_xla_option_through_the_api(demo_model, monkeypatch):
    monkeypatch.setenv("DJAX_XLA_OPTIONS", "xla_gpu_autotune_level=high")
    with pytest.raises(ValueError) as raised:
        djax.generate(demo_model, ["1+1="], djax.GenerationConfig(**SMALL))
    assert str(raised.value) == (
        "DJAX_XLA_OPTIONS: While setting option xla_gpu_autotune_level, 'high' is not a "
        "valid int32 value."
    )


def test_a_conversation_s_turns_as_the_cli_and_server_take_them(demo_model):
    """A message's content as a list of text parts is joined (it reached the chat template
    as the list's repr), `developer` is given as `system`; content that is not text, or a
    role that is not a string, is a PromptError naming the prompt and the message."""
    from djax import engine

    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "347+2958="}]
    halves = [{"type": "text", "text": "347+"}, {"type": "text", "text": "2958="}]
    parts = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": halves}]
    assert engine.tokenize(demo_model, [parts], True) == engine.tokenize(demo_model, [plain], True)
    for bad in (None, 5, [{"type": "image_url", "image_url": "x"}]):
        turns = [plain[0], {"role": "user", "content": bad}]
        with pytest.raises(engine.PromptError, match="prompt 1 has message 1 with role 'user'"):
            engine.tokenize(demo_model, ["1+1=", turns], True)
    with pytest.raises(engine.PromptError, match="has message 0 with role 3"):
        engine.tokenize(demo_model, [[{"role": 3, "content": "x"}]], True)


def test_an_empty_string_prompt_is_refused_with_or_without_chat(demo_model):
    """An empty string is refused as an empty id list is, also where the chat template
    would have wrapped it in tokens of its own."""
    from djax import engine

    for chat in (True, False):
        with pytest.raises(engine.PromptError, match="prompt 1 is an empty string"):
            engine.tokenize(demo_model, ["1+1=", ""], chat)


def test_a_conversation_is_a_prompt(demo_model):
    """A list of {"role", "content"} messages goes through the chat template, as a string
    prompt does under chat=True."""
    config = djax.GenerationConfig(gen_length=32, block_length=8)
    messages = [{"role": "user", "content": "12+345="}]
    out = djax.generate(demo_model, [messages], config)
    assert out.texts == ["357"]
    assert out.token_ids == djax.generate(demo_model, ["12+345="], config, chat=True).token_ids
