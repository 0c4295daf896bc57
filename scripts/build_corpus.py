"""Build the stdlib code corpus, its BPE tokenizer and the held-out prompts.

Writes, under --out:
  tokenizer/{tokenizer.json,tokenizer_config.json}  trained on the train split only
  train.npy, heldout.npy                           flat token ids, EOS after each file
  prompts.json                                     signature+docstring prompts (held-out)
  manifest.json                                    provenance and counts
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

# Lets the script run from a plain checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from specdec_jax import corpus  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Build the corpus artefacts and print a one-screen summary."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("build/corpus"), help="output directory")
    parser.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size")
    parser.add_argument("--max-prompts", type=int, default=64, help="held-out prompts to keep")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    root = corpus.stdlib_root()
    train_paths, heldout_paths = corpus.split_corpus(root)
    train_texts = corpus.read_texts(root, train_paths)
    heldout_texts = corpus.read_texts(root, heldout_paths)

    tokenizer_dir = corpus.train_tokenizer(train_texts, args.out / "tokenizer", vocab_size=args.vocab_size)
    train_ids = corpus.encode_corpus(tokenizer_dir, train_texts)
    heldout_ids = corpus.encode_corpus(tokenizer_dir, heldout_texts)
    np.save(args.out / "train.npy", train_ids)
    np.save(args.out / "heldout.npy", heldout_ids)

    prompts = corpus.heldout_prompts(root, max_prompts=args.max_prompts)
    (args.out / "prompts.json").write_text(json.dumps(prompts, indent=1) + "\n", encoding="utf-8")

    elapsed = time.perf_counter() - start
    manifest = {
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "stdlib_root": str(root),
        "vocab_size": args.vocab_size,
        "dtype": str(train_ids.dtype),
        "train_files": len(train_paths),
        "heldout_files": len(heldout_paths),
        "train_chars": sum(map(len, train_texts)),
        "heldout_chars": sum(map(len, heldout_texts)),
        "train_tokens": int(train_ids.size),
        "heldout_tokens": int(heldout_ids.size),
        "num_prompts": len(prompts),
        "heldout_modules": heldout_paths,
        "build_seconds": round(elapsed, 2),
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")

    print(f"corpus: {root} (Python {manifest['python_version']})")
    print(f"  train:   {len(train_paths):5d} files {manifest['train_chars']:>11,d} chars {train_ids.size:>11,d} tokens")
    print(f"  heldout: {len(heldout_paths):5d} files {manifest['heldout_chars']:>11,d} chars {heldout_ids.size:>11,d} tokens")
    print(f"  vocab {args.vocab_size}, {len(prompts)} prompts, {elapsed:.1f}s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
