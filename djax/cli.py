"""The `djax` command: `djax generate` (answers and stats), `djax serve` (an OpenAI-compatible
server) and `djax convert` (HF -> orbax).

Every `GenerationConfig` field is a `djax generate` option (`--gen-length`, `--decoder`, ...),
generated from the dataclass, and every kernel option comes from `djax.kernel_options`, so
the CLI and the Python API never drift apart. Nothing here imports jax, torch or
transformers until a command runs, so `djax --help` is quick.

`djax generate` runs the prompts in batches of `--batch-size`; SIGINT (Ctrl-C) and SIGTERM
stop it between device calls with one line on stderr and exit status 128 + the signal's
number (130, 143), the batches already finished kept in `--output-jsonl`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import signal
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args, get_type_hints

from djax import __version__, prompt_io
from djax.config import LLADA2, WEIGHTS, ConfigError, family_of, load_hf_config
from djax.generation import (
    DECODERS,
    FIXED_DECODERS,
    POLICIES,
    THRESHOLD_DECODERS,
    GenerationConfig,
    generation_defaults,
)
from djax.kernel_options import KERNEL_OPTIONS

log = logging.getLogger("djax")

DEFAULT_BATCH_SIZE = 32

_HELP = {
    "gen_length": "answer positions (LLaDA, LLaDA-MoE: rounded up to a multiple of --block-length)",
    "block_length": "positions per block, decoded left to right",
    "steps": "total steps of the fixed-steps decoders (low_confidence, random)",
    "decoder": "which masked positions a step commits",
    "threshold": "tau of threshold and credit, tau_high of hierarchy, in (0, 1]",
    "low_threshold": "tau_low of hierarchy, in (0, 1]",
    "factor": "f of the factor decoder, > 0",
    "credit_alpha": "alpha of the credit decoder, >= 0",
    "credit_gamma": "gamma of the credit decoder, > 0",
    "credit_beta": "beta of the credit decoder, in (0, 1]",
    "cache": "KV-cache policy",
    "refresh_every": "also refresh every k steps within a block (0: never)",
    "vicinity_before": "positions before the block that the vicinity cache feeds",
    "vicinity_after": "positions after the block that the vicinity cache feeds",
    "vicinity_warmup": "first steps of the generation that run without the vicinity cache",
    "temperature": "sampling temperature, finite and >= 0 (0: argmax)",
    "top_k": "a sampled token is one of the k most likely (0: any)",
    "top_p": "a sampled token is one of the fewest most likely whose probability reaches p, "
    "in (0, 1] (1: any)",
    "seed": "random seed, in [0, 2**32)",
    "stop_ids": "comma-separated token ids that end an answer",
    "early_stop": "stop a row after the block holding its first stop token",
    "smoothing": "iteration smoothing (soft embeddings of masked positions)",
    "logits_chunk": "vocabulary ids per chunk of a step's logits (0: the whole vocabulary)",
    "attention_sparsity": "fraction of key positions each attention head keeps for a block's "
    "cached steps, in (0, 1] (1: dense)",
    "attention_window": "positions before the block that sparse attention always keeps",
}
# Where a field's dataclass default is not what a user gets.
_DEFAULT_TEXT = {
    "steps": "--gen-length, one token per step",
    "stop_ids": "the model's EOS and end-of-turn ids",
}
_CHOICES = {"decoder": DECODERS, "cache": POLICIES}

_EPILOG = """examples:
  djax generate --prompt "347+2958="            the demo model that ships with djax
  djax generate --prompts-file prompts.txt --batch-size 64 --output-jsonl answers.jsonl
  djax generate --model LLaDA-8B-Instruct --chat --prompt "Why is the sky blue?" \\
      --gen-length 256 --block-length 32 --decoder threshold --cache dual
  djax convert LLaDA-8B-Instruct llada8b-djax
"""


def _field_type(field: dataclasses.Field) -> Any:
    hint = get_type_hints(GenerationConfig)[field.name]
    if isinstance(hint, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    return hint


def _add_generation_options(parser: argparse.ArgumentParser) -> None:
    """One option per `GenerationConfig` field; unset options stay None so the model's own
    defaults (the demo model's answer layout) can fill them."""
    group = parser.add_argument_group(
        "generation (djax.GenerationConfig)",
        "an option left out takes the model folder's generation_config.json value where it "
        "sets one (the demo model's sets its answer layout: --gen-length 32 --block-length 8), "
        "else the default shown",
    )
    for field in dataclasses.fields(GenerationConfig):
        flag = "--" + field.name.replace("_", "-")
        kind = _field_type(field)
        default = _DEFAULT_TEXT.get(field.name, "%s")
        if "%s" in default:
            shown = field.default
            if kind is bool:
                shown = "on" if field.default else "off"
            default = default % shown
        help_text = f"{_HELP[field.name]} (default: {default})"
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        elif getattr(kind, "__origin__", None) is tuple:
            group.add_argument(flag, type=_int_list, metavar="ID,ID,...", help=help_text)
        elif field.name in _CHOICES:
            group.add_argument(flag, choices=_CHOICES[field.name], help=help_text)
        else:
            group.add_argument(flag, type=kind, metavar=kind.__name__.upper(), help=help_text)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ids") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive int")
    return value


def _generation_config(args: argparse.Namespace, defaults: dict[str, Any]) -> GenerationConfig:
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(GenerationConfig)}
    return GenerationConfig(**(defaults | {k: v for k, v in given.items() if v is not None}))


# The generation options only some decoders or cache policies read: (the config field that
# chooses, the choices that read it). `steps` is read by every decoder under block diffusion.
_READ_BY = {
    "steps": ("decoder", FIXED_DECODERS),
    "threshold": ("decoder", THRESHOLD_DECODERS),
    "low_threshold": ("decoder", ("hierarchy",)),
    "factor": ("decoder", ("factor",)),
    "credit_alpha": ("decoder", ("credit",)),
    "credit_gamma": ("decoder", ("credit",)),
    "credit_beta": ("decoder", ("credit",)),
    "vicinity_before": ("cache", ("vicinity",)),
    "vicinity_after": ("cache", ("vicinity",)),
    "vicinity_warmup": ("cache", ("vicinity",)),
}


def _block_diffusion(path: str) -> bool | None:
    """Whether the model folder's config.json names a block-diffusion family (LLaDA2);
    None where it cannot be read (the load says why)."""
    try:
        return family_of(load_hf_config(path), "config.json") == LLADA2
    except ConfigError:
        return None


def _check_options_read(args: argparse.Namespace, config: GenerationConfig, path: str) -> None:
    """A ValueError naming a generation option given on the command line that the decoder or
    cache policy chosen never reads (the answer would be the same without it), as the server
    refuses a `threshold` its decoder takes none of."""
    for name, (chooser, readers) in _READ_BY.items():
        value, chosen = getattr(args, name), getattr(config, chooser)
        if value is None or chosen in readers:
            continue
        if name == "steps" and _block_diffusion(path) is not False:
            continue  # block diffusion splits steps over the blocks under every decoder
        flag = "--" + name.replace("_", "-")
        raise ValueError(
            f"{flag} {value} is read only by --{chooser} {'|'.join(readers)}; --{chooser} "
            f"{chosen} never reads it, so it would not change the answers: expected no "
            f"{flag}, or another --{chooser}"
        )


def _logging_options() -> argparse.ArgumentParser:
    """`--verbose` / `--quiet`, shared by every command."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_mutually_exclusive_group()
    group.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="more messages (INFO): generate logs each batch's stats",
    )
    group.add_argument(
        "-q", "--quiet", action="store_true", help="log errors only (no warnings, no progress)"
    )
    return parent


def _add_model_options(gen: argparse.ArgumentParser) -> None:
    model = gen.add_argument_group("model")
    model.add_argument(
        "--model",
        metavar="DIR",
        help="HF model folder or `djax convert` output "
        "(default: the small demo model shipped with djax)",
    )
    model.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        help="compute and storage dtype (default: bfloat16 on GPUs, float32 on the CPU)",
    )
    model.add_argument(
        "--weights",
        choices=WEIGHTS,
        help="fp8: projection and expert weights as e4m3 with a scale per output channel "
        "(default: what a converted folder holds, else dtype: every weight in --dtype)",
    )
    model.add_argument(
        "--allow-pickle",
        action="store_true",
        help="accept pickled pytorch_model*.bin weights (unpickling can run code)",
    )
    model.add_argument(
        "--tensor-parallel",
        "--tensor-parallel-size",  # vLLM's name
        type=_positive_int,
        default=1,
        metavar="N",
        help="split heads, MLP and vocabulary over N devices (default: 1)",
    )
    model.add_argument(
        "--expert-parallel",
        type=_positive_int,
        default=1,
        metavar="M",
        help="split MoE experts over M devices (a dense model: as --tensor-parallel) (default: 1)",
    )
    kernels = gen.add_argument_group("kernels (djax.load options)")
    for option in KERNEL_OPTIONS.values():
        kernels.add_argument(
            option.flag,
            choices=option.choices,
            default="auto",
            help=f"auto: {option.auto} (default: auto)",
        )


def _add_io_options(gen: argparse.ArgumentParser) -> None:
    inputs = gen.add_argument_group(
        "prompts", "give one of --prompt, --prompts-file, --input-jsonl"
    )
    source = inputs.add_mutually_exclusive_group()
    source.add_argument(
        "--prompt",
        action="append",
        metavar="TEXT",
        help="a prompt; repeat for several (default: the demo model's examples)",
    )
    source.add_argument("--prompts-file", metavar="FILE", help="one prompt per line")
    source.add_argument(
        "--input-jsonl",
        metavar="FILE",
        help='one JSON object per line: {"id": ..., "prompt": "..."} or {"id": ..., '
        '"messages": [{"role": "user", "content": "..."}]} (multi-line prompts, '
        "conversations; id defaults to the line number)",
    )
    inputs.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the tokenizer's chat template to text prompts (default: on for the "
        "demo model, off otherwise; messages always take it)",
    )
    run = gen.add_argument_group("batches and output")
    run.add_argument(
        "--batch-size",
        type=_positive_int,
        default=DEFAULT_BATCH_SIZE,
        metavar="N",
        help=f"prompts per device call; Ctrl-C stops between calls (default: {DEFAULT_BATCH_SIZE})",
    )
    run.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a progress bar on stderr (default: when stderr is a terminal)",
    )
    output = run.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the whole result as JSON")
    output.add_argument(
        "--output-jsonl",
        metavar="FILE",
        help="append one record per prompt (id, prompt or messages, answer, token_ids, "
        "the batch's stats) after each batch; an existing FILE resumes: ids it holds are "
        "skipped",
    )


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors, as djax's own: `PROG: error: MESSAGE` on stderr (no
    usage block; `--help` lists the options) and exit status 2. Subcommands get it too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    common = _logging_options()
    parser = _Parser(
        prog="djax",
        description=" ".join(__doc__.split("\n\n")[0].split()),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.set_defaults(subcommands=commands.choices)  # name -> its parser, for its errors

    gen = commands.add_parser(
        "generate",
        parents=[common],
        help="generate answers and print them with stats",
        description="Generate answers for prompts and report forwards, tokens per forward "
        "and tokens/s. Ctrl-C or SIGTERM stops between batches (exit 130 or 143).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_io_options(gen)
    _add_model_options(gen)
    gen.add_argument(
        "--explain",
        action="store_true",
        help="print the device, the kernel options and the kernels they resolve to for the "
        "first batch's program, before generating (under --json: its `kernels` entry)",
    )
    _add_generation_options(gen)

    from djax.serving import cli as serving_cli

    serving_cli.add_parser(commands, [common])

    conv = commands.add_parser(
        "convert",
        parents=[common],
        help="HF folder -> orbax folder djax.load opens",
        description="Convert an HF model folder to an orbax checkpoint folder.",
    )
    conv.add_argument("src", help="HF model folder (config.json, *.safetensors, tokenizer)")
    conv.add_argument("dst", help="output folder (must be empty unless --overwrite)")
    conv.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="stored dtype (default: bfloat16)",
    )
    conv.add_argument(
        "--weights",
        default="dtype",
        choices=WEIGHTS,
        help="fp8: store projection and expert weights as e4m3 with a scale per output "
        "channel (default: dtype, every weight in --dtype)",
    )
    conv.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty dst that djax convert wrote (one holding djax.json)",
    )
    conv.add_argument(
        "--allow-pickle",
        action="store_true",
        help="accept pickled pytorch_model*.bin weights (unpickling can run code)",
    )
    return parser


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(BaseException):
    """A stop signal (SIGINT, SIGTERM) arrived; not an Exception, so no `except Exception`
    swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class StopSignals:
    """While installed (a context manager), SIGINT and SIGTERM raise `Stopped` in the main
    thread, when it next runs Python code (so a device call finishes first). Inside
    `deferred()` a stop waits for the block's end, so a batch's output and its count are
    never cut in two."""

    def __init__(self):
        self._deferring = False
        self._pending: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        self._previous = {s: signal.signal(s, self._stop) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _stop(self, signum: int, frame: Any) -> None:
        if self._deferring:
            self._pending = signum
        else:
            raise Stopped(signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._pending is not None:
            raise Stopped(self._pending)


def _records(args: argparse.Namespace, demo_model: bool) -> list[prompt_io.PromptRecord]:
    for flag, path, read in (
        ("--prompts-file", args.prompts_file, prompt_io.read_prompts_file),
        ("--input-jsonl", args.input_jsonl, prompt_io.read_jsonl),
    ):
        if path:
            try:
                return read(path)
            except OSError as err:  # the OS's words, with the flag that named the file
                raise OSError(f"{flag} {path}: {err.strerror or err}") from None
    if args.prompt:
        return prompt_io.from_texts(args.prompt)
    if demo_model:
        from djax import demo

        return prompt_io.from_texts(demo.EXAMPLE_PROMPTS)
    raise ValueError("no prompts; give --prompt TEXT, --prompts-file FILE or --input-jsonl FILE")


@dataclasses.dataclass
class Progress:
    """What a generate run has done so far: records finished and their batches' stats, and
    under `--json` the result being built (`run_generate`'s, its answers those of the
    finished batches)."""

    total: int
    done: int = 0
    written: int = 0
    stats: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    result: dict[str, Any] | None = None


def _totals(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The batches' stats added up (rates recomputed from the sums)."""
    summed = {k: sum(s[k] for s in stats) for k in stats[0]} if stats else {}
    if summed:
        summed["tokens_per_forward"] = summed["generated_tokens"] / max(summed["forwards"], 1)
        seconds = summed["seconds"]
        summed["tokens_per_second"] = summed["generated_tokens"] / seconds if seconds else 0.0
        summed["batches"] = len(stats)
    return summed


def _settings(args: argparse.Namespace, path: str, config: GenerationConfig, chat: bool) -> dict:
    """What an answer was asked with, as output records keep it (JSON values): the model
    folder, its weight format and dtype as asked, the chat template's use and the generation
    config."""
    settings = {
        "model": str(Path(path).resolve()),
        "weights": args.weights,
        "dtype": args.dtype,
        "chat": chat,
        "generation": dataclasses.asdict(config),
    }
    return json.loads(json.dumps(settings))


def _differences(old: dict, new: dict) -> str:
    """The settings that differ, as "name old -> new" (generation fields by their own name)."""

    def flat(settings: dict) -> dict:
        rest = {k: v for k, v in settings.items() if k != "generation"}
        return rest | settings.get("generation", {})

    old, new = flat(old), flat(new)
    keys = [k for k in dict.fromkeys([*old, *new]) if old.get(k) != new.get(k)]
    return ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys)


def _unfinished(
    args: argparse.Namespace, records: list[prompt_io.PromptRecord], settings: dict
) -> list:
    """`records` less those whose ids `--output-jsonl` already holds (a warning says so);
    a ValueError where the file answered an id for another prompt or with other
    `settings`."""
    if not args.output_jsonl:
        return records
    source = args.input_jsonl or args.prompts_file
    if source and Path(source).resolve() == Path(args.output_jsonl).resolve():
        raise ValueError(
            f"--output-jsonl {args.output_jsonl} is the prompts' own file; expected another file"
        )
    done = prompt_io.finished(args.output_jsonl)
    for r in records:
        if r.id not in done:
            continue
        prompt, written_with = done[r.id]
        if prompt != r.prompt:
            raise ValueError(
                f"{args.output_jsonl} holds an answer for id {r.id!r} to another prompt "
                f"({prompt!r:.60} against {r.prompt!r:.60}); expected the prompts of the "
                "run that wrote it, or another --output-jsonl"
            )
        if written_with is not None and written_with != settings:
            raise ValueError(
                f"{args.output_jsonl} holds an answer for id {r.id!r} generated with other "
                f"settings ({_differences(written_with, settings)}); expected the settings "
                "of the run that wrote it, or another --output-jsonl"
            )
    todo = [r for r in records if r.id not in done]
    if len(todo) < len(records):
        log.warning(
            "%s already holds %d of the %d prompts; generating the other %d",
            args.output_jsonl,
            len(records) - len(todo),
            len(records),
            len(todo),
        )
    return todo


def _load(args: argparse.Namespace, path: str, progress: bool) -> Any:
    import djax

    mesh = None
    if args.tensor_parallel > 1 or args.expert_parallel > 1:
        from djax.sharding import make_mesh

        mesh = make_mesh(tensor_parallel=args.tensor_parallel, expert_parallel=args.expert_parallel)
    log.info("loading %s", path)
    return djax.load(
        path,
        args.dtype,
        mesh=mesh,
        weights=args.weights,
        allow_pickle=args.allow_pickle,
        progress=progress,
        **{name: getattr(args, name) for name in KERNEL_OPTIONS},
    )


def run_generate(
    args: argparse.Namespace,
    progress: Progress | None = None,
    stops: StopSignals | None = None,
) -> dict[str, Any]:
    """Generate the answers `args` asks for, batch by batch, each batch's answers printed
    or (`--output-jsonl`) appended as it finishes. Returns the model's label, the notes and
    the summed stats, and under `--json` also every prompt, text and token-id list (only
    then are they all kept in memory). `progress` is updated as batches finish (each
    batch's output and count under `stops.deferred()`), so a caller stopped by a signal can
    say what was kept."""
    from djax import demo

    stops = stops or StopSignals()
    path = args.model or str(demo.default_model_path())
    label = demo.describe(path)  # None unless the folder holds a demo model
    config = _generation_config(args, generation_defaults(path))
    _check_options_read(args, config, path)
    chat = bool(label) if args.chat is None else args.chat
    settings = _settings(args, path, config, chat)
    records = _unfinished(args, _records(args, bool(label)), settings)
    progress = progress or Progress(len(records))
    progress.total = len(records)
    result = {"model": f"{path} ({label})" if label else path, "notes": [], "stats": {}}
    if args.json:
        result |= {"prompts": [], "texts": [], "token_ids": []}
        progress.result = result
    if not records:
        return result
    show_progress = sys.stderr.isatty() if args.progress is None else args.progress
    show_progress = show_progress and not args.quiet
    model = _load(args, path, show_progress)
    if not args.json:
        print(f"model: {result['model']}", flush=True)
    from tqdm import tqdm

    import djax

    if args.explain:
        first = next(iter(prompt_io.batches(records, args.batch_size)))
        with _named_prompts(first):
            explanation = _explain(model, [r.prompt for r in first], config, chat)
        if args.json:
            result["kernels"] = explanation
        else:
            print(explanation, flush=True)
    with tqdm(total=len(records), unit="prompt", file=sys.stderr, disable=not show_progress) as bar:
        for batch in prompt_io.batches(records, args.batch_size):
            with _named_prompts(batch):
                out = djax.generate(model, [r.prompt for r in batch], config, chat=chat)
            stats = dataclasses.asdict(out.stats)
            texts = out.texts or [None] * len(batch)
            with stops.deferred():
                if args.output_jsonl:
                    prompt_io.append_records(
                        args.output_jsonl,
                        (
                            r.fields()
                            | {"answer": t, "token_ids": ids, "stats": stats, "settings": settings}
                            for r, t, ids in zip(batch, texts, out.token_ids, strict=True)
                        ),
                    )
                    progress.written += len(batch)
                elif not args.json:
                    for r, text in zip(batch, texts, strict=True):
                        print(f"\n> {_shown(r)}\n{text}", flush=True)
                if args.json:
                    result["prompts"] += [r.prompt for r in batch]
                    result["texts"] += texts
                    result["token_ids"] += out.token_ids
                result["notes"] += [n for n in out.notes if n not in result["notes"]]
                progress.stats.append(stats)
                progress.done += len(batch)
            log.info("batch of %d: %s", len(batch), _stats_line(stats))
            bar.update(len(batch))
    result["stats"] = _totals(progress.stats)
    return result


@contextlib.contextmanager
def _named_prompts(batch: list[prompt_io.PromptRecord]) -> Iterator[None]:
    """A prompt the engine refuses (`engine.PromptError`, which counts prompts within the
    batch) named by its record's id, as the user's file or `--prompt` order gives it."""
    from djax import engine

    try:
        yield
    except engine.PromptError as err:
        raise ValueError(f"prompt id {batch[err.index].id!r} {err.detail}") from None


def _explain(model: Any, prompts: list[Any], config: GenerationConfig, chat: bool) -> str:
    """`djax.engine.explain` for the program that generates `prompts`, planned as
    `djax.generate` plans it (`engine.plan_prompts`), so explaining never changes whether a
    run is accepted."""
    from djax import engine

    _, plan, _ = engine.plan_prompts(model, prompts, config, chat)
    return engine.explain(model, plan)


def _shown(record: prompt_io.PromptRecord) -> str:
    """A prompt as the text output shows it: a conversation by its last message."""
    return record.prompt[-1]["content"] if record.is_conversation else record.prompt


def _stats_line(s: dict[str, Any]) -> str:
    return (
        f"forwards {s['forwards']} (refreshes {s['refreshes']}), blocks {s['blocks']}, "
        f"tokens {s['generated_tokens']}, tokens/forward {s['tokens_per_forward']:.2f}, "
        f"{s['tokens_per_second']:.1f} tokens/s ({s['seconds'] * 1e3:.1f} ms; "
        f"compile {s['compile_seconds']:.1f} s)"
    )


def _print_result(args: argparse.Namespace, result: dict[str, Any], progress: Progress) -> None:
    if args.json:
        print(json.dumps(result, indent=2))
        return
    if args.output_jsonl:
        print(f"wrote {progress.written} answers to {args.output_jsonl}")
    for note in result["notes"]:
        print(f"note: {note}")
    if result["stats"]:
        batches = result["stats"]["batches"]
        print(f"{batches} batch{'es' if batches > 1 else ''}: {_stats_line(result['stats'])}")


def _configure_logging(args: argparse.Namespace) -> None:
    level = logging.INFO if args.verbose else logging.ERROR if args.quiet else logging.WARNING
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("djax: %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False


def _convert(args: argparse.Namespace) -> None:
    import djax

    out = djax.convert(
        args.src,
        args.dst,
        args.dtype,
        overwrite=args.overwrite,
        allow_pickle=args.allow_pickle,
        progress=not args.quiet and sys.stderr.isatty(),  # a bar only where one is seen
        weights=args.weights,
    )
    print(f"wrote {out}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's arguments; one the command does not take is refused by the
    command's own parser (`djax generate: error: unrecognized arguments: ... (djax generate
    --help lists the options)`), which lists them, not by the top level's, which does not."""
    args, extras = build_parser().parse_known_args(argv)
    if extras:
        args.subcommands[args.command].error(f"unrecognized arguments: {' '.join(extras)}")
    del args.subcommands
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    _configure_logging(args)
    if args.command == "serve":  # uvicorn handles SIGINT and SIGTERM itself: it drains
        from djax.serving import cli as serving_cli

        return serving_cli.run(args)
    progress = Progress(0)
    try:
        with StopSignals() as stops:
            if args.command == "convert":
                _convert(args)
                return 0
            result = run_generate(args, progress, stops)
            _print_result(args, result, progress)
    except Stopped as stop:
        print(f"djax: {_stopped_line(args, stop.signum, progress)}", file=sys.stderr)
        if progress.result is not None:  # --json: the finished batches' answers
            stopped = {
                "stats": _totals(progress.stats),
                "stopped": signal.Signals(stop.signum).name,
            }
            print(json.dumps(progress.result | stopped, indent=2))
        return 128 + stop.signum
    except (ValueError, TypeError, OSError) as err:
        print(f"djax: error: {err}", file=sys.stderr)
        return 2
    return 0


def _stopped_line(args: argparse.Namespace, signum: int, progress: Progress) -> str:
    line = f"stopped by {signal.Signals(signum).name}"
    if args.command != "generate":
        return line
    line += f" after {progress.done} of {progress.total} prompts"
    if args.output_jsonl:
        line += f"; {progress.written} answers written to {args.output_jsonl} (run again to resume)"
    return line


if __name__ == "__main__":
    sys.exit(main())
