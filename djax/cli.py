"""The `djax` command: `djax generate` (text and stats) and `djax convert` (HF -> orbax).

Every `GenerationConfig` field is a `djax generate` option (`--gen-length`, `--decoder`, ...),
generated from the dataclass so the CLI and the Python API never drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
from pathlib import Path
from typing import Any, get_args, get_type_hints

from djax.engine import GenerationConfig, generation_defaults

_HELP = {
    "gen_length": "answer positions (rounded up to a multiple of --block-length)",
    "block_length": "positions per block, decoded left to right",
    "steps": "total steps of the fixed-steps decoders (default: gen-length)",
    "decoder": "low_confidence | random | threshold | factor | credit | hierarchy",
    "threshold": "tau of threshold/credit, tau_high of hierarchy",
    "low_threshold": "tau_low of hierarchy",
    "factor": "f of the factor decoder",
    "cache": "none | prefix | dual | vicinity",
    "refresh_every": "also refresh every k steps within a block (0: never)",
    "stop_ids": "comma-separated ids that end an answer (default: EOS and end-of-turn)",
    "early_stop": "stop a row after the block holding its first stop token",
    "smoothing": "iteration smoothing (soft embeddings of masked positions)",
}


def _field_type(field: dataclasses.Field) -> Any:
    hint = get_type_hints(GenerationConfig)[field.name]
    if isinstance(hint, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    return hint


def _add_generation_options(parser: argparse.ArgumentParser) -> None:
    """One option per `GenerationConfig` field; unset options stay None so the model's own
    defaults (the demo model's answer layout) can fill them."""
    for field in dataclasses.fields(GenerationConfig):
        flag = "--" + field.name.replace("_", "-")
        kind = _field_type(field)
        help_text = f"{_HELP.get(field.name, '')} (default: {field.default})".strip()
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        elif getattr(kind, "__origin__", None) is tuple:
            parser.add_argument(flag, type=_int_list, help=help_text)
        else:
            parser.add_argument(flag, type=kind, help=help_text)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ids") from None


def _generation_config(args: argparse.Namespace, defaults: dict[str, Any]) -> GenerationConfig:
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(GenerationConfig)}
    return GenerationConfig(**(defaults | {k: v for k, v in given.items() if v is not None}))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="djax", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate answers and print text and stats")
    gen.add_argument(
        "--model",
        help="HF model folder or `djax convert` output "
        "(default: the small demo model shipped with djax)",
    )
    source = gen.add_mutually_exclusive_group()
    source.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    source.add_argument("--prompts-file", help="a file with one prompt per line")
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the tokenizer's chat template (default: on for the demo model)",
    )
    gen.add_argument("--dtype", help="bfloat16 | float32 (default: bf16 on GPU, fp32 on CPU)")
    gen.add_argument(
        "--tensor-parallel", type=int, default=1, help="split heads/ffn/vocab over N devices"
    )
    gen.add_argument(
        "--expert-parallel", type=int, default=1, help="split MoE experts over M devices"
    )
    gen.add_argument(
        "--attention-impl", default="auto", help="auto (split_kv on GPUs) | xla | cudnn | split_kv"
    )
    gen.add_argument(
        "--mlp-impl",
        default="auto",
        help="auto (pallas on GPUs for <= 32 token rows, 16-bit weights) | xla | pallas",
    )
    gen.add_argument(
        "--moe-impl",
        default="auto",
        help="auto (pallas on GPUs) | grouped | dense | hopper | pallas",
    )
    gen.add_argument(
        "--matmul-impl",
        default="auto",
        help="q/k/v, output and down products: auto (split-K pallas on GPUs for <= 32 token "
        "rows, 16-bit weights) | xla | pallas",
    )
    gen.add_argument(
        "--norm-impl",
        default="auto",
        help="residual add + RMSNorm: auto (fused on H100s, tiled on other GPUs, 16-bit "
        "weights) | xla | pallas | fused (in the block products' kernels) | tiled (the add in "
        "a column-tiled kernel after the split-K product, the norm in the next product)",
    )
    gen.add_argument(
        "--rope-impl",
        default="auto",
        help="q/k norm, RoPE and K/V writes: auto (pallas on GPUs, 16-bit weights) | xla | pallas",
    )
    gen.add_argument("--json", action="store_true", help="print the output as JSON")
    _add_generation_options(gen)

    conv = commands.add_parser("convert", help="HF folder -> orbax folder djax.load opens")
    conv.add_argument("src", help="HF model folder (config.json, *.safetensors, tokenizer)")
    conv.add_argument("dst", help="output folder (must be empty unless --overwrite)")
    conv.add_argument("--dtype", default="bfloat16", help="stored dtype (default: bfloat16)")
    conv.add_argument("--overwrite", action="store_true", help="replace a non-empty dst")
    conv.add_argument(
        "--allow-pickle",
        action="store_true",
        help="accept pickled pytorch_model*.bin weights (runs unpickling)",
    )
    return parser


def _prompts(args: argparse.Namespace, default: list[str]) -> list[str]:
    if args.prompts_file:
        lines = Path(args.prompts_file).read_text().splitlines()
        prompts = [line for line in lines if line.strip()]
        if not prompts:
            raise SystemExit(f"djax: {args.prompts_file} holds no prompts")
        return prompts
    return args.prompt or default


def run_generate(args: argparse.Namespace) -> dict[str, Any]:
    import djax
    from djax import demo

    path = args.model or str(demo.default_model_path())
    label = demo.describe(path)  # None unless the folder holds a demo model
    config = _generation_config(args, generation_defaults(path))
    mesh = None
    if args.tensor_parallel > 1 or args.expert_parallel > 1:
        from djax.sharding import make_mesh

        mesh = make_mesh(tensor_parallel=args.tensor_parallel, expert_parallel=args.expert_parallel)
    model = djax.load(
        path,
        args.dtype,
        mesh=mesh,
        attention_impl=args.attention_impl,
        mlp_impl=args.mlp_impl,
        moe_impl=args.moe_impl,
        matmul_impl=args.matmul_impl,
        norm_impl=args.norm_impl,
        rope_impl=args.rope_impl,
    )
    prompts = _prompts(args, list(demo.EXAMPLE_PROMPTS) if label else [])
    if not prompts:
        raise SystemExit("djax: give --prompt TEXT or --prompts-file FILE")
    chat = bool(label) if args.chat is None else args.chat
    out = djax.generate(model, prompts, config, chat=chat)
    return {
        "model": f"{path} ({label})" if label else path,
        "prompts": prompts,
        "texts": out.texts,
        "token_ids": out.token_ids,
        "notes": out.notes,
        "stats": dataclasses.asdict(out.stats),
    }


def _print_result(result: dict[str, Any]) -> None:
    print(f"model: {result['model']}")
    for prompt, text in zip(result["prompts"], result["texts"] or [], strict=False):
        print(f"\n> {prompt}\n{text}")
    for note in result["notes"]:
        print(f"\nnote: {note}")
    s = result["stats"]
    print(
        f"\nforwards {s['forwards']} (refreshes {s['refreshes']}), blocks {s['blocks']}, "
        f"tokens {s['generated_tokens']}, tokens/forward {s['tokens_per_forward']:.2f}, "
        f"{s['tokens_per_second']:.1f} tokens/s ({s['seconds'] * 1e3:.1f} ms; "
        f"compile {s['compile_seconds']:.1f} s)"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "convert":
            import djax

            out = djax.convert(
                args.src,
                args.dst,
                args.dtype,
                overwrite=args.overwrite,
                allow_pickle=args.allow_pickle,
            )
            print(f"wrote {out}")
            return 0
        result = run_generate(args)
    except (ValueError, OSError, TypeError) as err:
        print(f"djax: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("djax: interrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
