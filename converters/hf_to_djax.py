"""Convert an HF LLaDA / LLaDA-MoE folder into the orbax checkpoint that `djax.load` opens.

    python converters/hf_to_djax.py SRC DST [--dtype bfloat16] [--overwrite] [--allow-pickle]

The same as `djax convert`: config and tokenizer files are copied along, shapes and dtypes
are checked before anything is written, a progress bar shows the params as they are read,
and a non-empty DST is refused unless --overwrite.
"""

import sys

from djax.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
