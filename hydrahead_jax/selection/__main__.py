"""Head selection from the command line:

    python -m hydrahead_jax.selection --source smollm2-135m --ratio 7:1 --allocation global \
        --method combined --out runs/select
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hydrahead_jax.config import ConfigError
from hydrahead_jax.data.protocol import TokenizerModelMismatchError, check_tokenizer
from hydrahead_jax.hybrid.head_map import HeadMapError
from hydrahead_jax.models.loaders import CheckpointError
from hydrahead_jax.selection import SelectionError
from hydrahead_jax.selection.select import ALLOCATIONS, METHODS, SelectionConfig, run_selection, validate_config


def main(argv: Sequence[str] | None = None):
    """Parse, check everything (source, settings, tokenizer, prompt lengths) before any probe, then select.

    An input error prints one ``error:`` line (what and the fix) and exits with status 2, like train.py."""
    try:
        return _select(argv)
    except (ConfigError, CheckpointError, HeadMapError, SelectionError, TokenizerModelMismatchError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except OSError as err:  # --out not writable, a file that vanished
        print(f"error: {err.filename or ''}: {err.strerror or err}", file=sys.stderr, flush=True)
        sys.exit(2)


def _select(argv: Sequence[str] | None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="smollm2-135m", help="teacher: smollm2-135m, a .gguf or an HF folder")
    p.add_argument("--out", required=True, help="folder for head_map.json and head_scores.png")
    p.add_argument("--ratio", default="7:1", help="LA:FA like 7:1 or 3:1, a percentage, or an FA fraction")
    p.add_argument("--allocation", default="global", choices=ALLOCATIONS)
    p.add_argument("--method", default="combined", choices=METHODS)
    p.add_argument("--preset", default="demo", choices=("demo", "paper"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--niah_prompts", type=int)
    p.add_argument("--niah_lengths", help="comma-separated token lengths, e.g. 256,512")
    p.add_argument("--niah_depths", help="comma-separated depths in [0, 1]")
    p.add_argument("--decode", choices=("greedy", "teacher_forced"))
    p.add_argument("--ablation_prompts", type=int)
    p.add_argument("--ablation_length", type=int)
    p.add_argument("--ablation_mode", choices=("mean", "zero"))
    p.add_argument("--ablation_scope", choices=("answer", "all"))
    p.add_argument("--group_aggregate", choices=("mean", "max"))
    args = vars(p.parse_args(argv))
    source, out, preset = args.pop("source"), args.pop("out"), args.pop("preset")
    sel = SelectionConfig.from_any(dict(args, preset=preset))  # unset (None) settings: the preset's values
    from hydrahead_jax.models import load_pretrained

    model, tokenizer = load_pretrained(source)
    # Before any probe runs: ids within the model's vocabulary, every probe prompt fits its length.
    check_tokenizer(tokenizer, model.cfg.vocab_size, model_name=repr(source))
    validate_config(sel, model.cfg, tokenizer)
    return run_selection(model, tokenizer, sel, out)


if __name__ == "__main__":
    main()
