"""The `djax` command: generation on the shipped demo model, options, conversion, errors."""

import json

import djax
from djax.cli import main


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
        "--json",
    ]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["stats"]["forwards"] == 8 and result["stats"]["refreshes"] == 8


def test_errors_are_reported(capsys, dense_folder, tmp_path):
    assert (
        main(["generate", "--model", str(dense_folder[0]), "--prompt", "x", "--decoder", "greedy"])
        == 2
    )
    assert "decoder='greedy'; expected one of" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "none"), "--prompt", "x"]) == 2
    assert "is not a folder" in capsys.readouterr().err
    for flag in ("--mlp-impl", "--matmul-impl", "--norm-impl", "--rope-impl"):
        bad_impl = ["generate", "--model", str(dense_folder[0]), "--prompt", "x", flag, "fast"]
        assert main(bad_impl) == 2
        option = flag[2:].replace("-", "_")
        assert f"{option}='fast'; expected one of" in capsys.readouterr().err


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


def test_converter_script(dense_folder, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "converters" / "hf_to_djax.py"
    out = tmp_path / "converted"
    run = subprocess.run(
        [sys.executable, str(script), str(dense_folder[0]), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert (out / "djax.json").is_file() and (out / "config.json").is_file()
    again = subprocess.run(
        [sys.executable, str(script), str(dense_folder[0]), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 2 and "is not empty" in again.stderr
