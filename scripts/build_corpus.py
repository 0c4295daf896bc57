"""Build the code corpus, its BPE tokenizer and the held-out prompts.

Sources (--sources): the running interpreter's standard library and the Python files of every
installed distribution (site-packages), deduplicated by text; held out are the stdlib's fixed
modules plus whole package directories chosen by a stable hash (--heldout-fraction). Offline and
reproducible given the same installed packages: the manifest lists every file.

Writes, under --out:
  tokenizer/{tokenizer.json,tokenizer_config.json}  trained on (a stable sample of) the train split
  train.npy, heldout.npy                           flat token ids, EOS after each file
  prompts.json                                     signature+docstring prompts (held-out)
  manifest.json                                    provenance, counts, packages with versions and licences
  corpus_manifest.json.gz                          every file by package: version, split, path, sha256 prefix
  LICENSES.md                                      the packages' licences (copied into each checkpoint)
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import platform
import shutil
import sys
import time
from pathlib import Path

# Lets the script run from a plain checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from specdec_jax.training import corpus  # noqa: E402

SOURCES = ("stdlib", "site-packages")


def _sources(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in names if s not in SOURCES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {SOURCES}, got {text!r}")
    return names


def _chars(files) -> int:
    return sum(len(f.text) for f in files)


def main(argv: list[str] | None = None) -> int:
    """Build the corpus artefacts and print a one-screen summary."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("build/corpus"), help="output directory")
    parser.add_argument("--sources", type=_sources, default=SOURCES, help="stdlib, site-packages or both")
    parser.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size")
    parser.add_argument("--max-prompts", type=int, default=64, help="held-out prompts to keep")
    parser.add_argument("--heldout-fraction", type=float, default=0.02,
                        help="share of site-packages directories held out (stable hash of package:dir)")
    parser.add_argument("--max-train-chars", type=float, default=350e6,
                        help="cap on the train split (files kept in stable hash order); 0 = no cap")
    parser.add_argument("--tokenizer-chars", type=float, default=40e6,
                        help="train the BPE on a stable sample of this many train characters; 0 = all")
    parser.add_argument("--max-file-bytes", type=int, default=400_000, help="larger files (generated) are skipped")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="reuse this tokenizer folder (e.g. a shipped checkpoint's) instead of training one")
    args = parser.parse_args(argv)
    if not 0.0 <= args.heldout_fraction < 1.0:
        parser.error(f"--heldout-fraction must be in [0, 1), got {args.heldout_fraction}")

    start = time.perf_counter()
    files, packages = [], {}
    if "stdlib" in args.sources:
        files += corpus.stdlib_sources()
    if "site-packages" in args.sources:
        installed, packages = corpus.installed_sources(args.max_file_bytes)
        files += installed
    files = corpus.deduplicate(files)
    train, heldout = corpus.split_by_module(files, args.heldout_fraction)
    train = corpus.cap_chars(train, int(args.max_train_chars))
    if not train or not heldout:
        sys.exit(f"error: the corpus split left {len(train)} train and {len(heldout)} held-out files")
    t_read = time.perf_counter() - start

    args.out.mkdir(parents=True, exist_ok=True)
    sample = corpus.cap_chars(train, int(args.tokenizer_chars))
    if args.tokenizer is None:
        tokenizer_dir = corpus.train_tokenizer([f.text for f in sample], args.out / "tokenizer",
                                               vocab_size=args.vocab_size)
    else:  # the same ids as a model already trained on this corpus
        tokenizer_dir = args.out / "tokenizer"
        tokenizer_dir.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(args.tokenizer / name, tokenizer_dir / name)
    t_tok = time.perf_counter() - start - t_read
    train_ids = corpus.encode_corpus(tokenizer_dir, [f.text for f in train])
    heldout_ids = corpus.encode_corpus(tokenizer_dir, [f.text for f in heldout])
    np.save(args.out / "train.npy", train_ids)
    np.save(args.out / "heldout.npy", heldout_ids)

    prompts = corpus.prompts_from_texts([f.text for f in heldout], args.max_prompts)
    (args.out / "prompts.json").write_text(json.dumps(prompts, indent=1) + "\n", encoding="utf-8")

    counts = collections.Counter(f.package for f in train + heldout)
    with gzip.open(args.out / "corpus_manifest.json.gz", "wt", encoding="utf-8", compresslevel=9) as fh:
        json.dump({"sha256_hex_digits": corpus.MANIFEST_HASH_HEX, "packages": corpus.file_manifest(train, heldout)},
                  fh, separators=(",", ":"))
    (args.out / "LICENSES.md").write_text(corpus.licence_note(packages, counts), encoding="utf-8")

    elapsed = time.perf_counter() - start
    manifest = {
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "sources": list(args.sources),
        "vocab_size": args.vocab_size,
        "dtype": str(train_ids.dtype),
        "train_files": len(train),
        "heldout_files": len(heldout),
        "packages": len(counts),
        "train_chars": _chars(train),
        "heldout_chars": _chars(heldout),
        "tokenizer_sample_chars": _chars(sample) if args.tokenizer is None else 0,
        "tokenizer_from": str(args.tokenizer) if args.tokenizer is not None else "trained on the train split",
        "train_tokens": int(train_ids.size),
        "heldout_tokens": int(heldout_ids.size),
        "num_prompts": len(prompts),
        "heldout_fraction": args.heldout_fraction,
        "max_train_chars": int(args.max_train_chars),
        "heldout_groups": sorted({f.module_group for f in heldout}),
        "package_versions": {name: (packages.get(name, {}).get("version") or platform.python_version())
                             for name in sorted(counts, key=str.lower)},
        "seconds": {"read": round(t_read, 2), "tokenizer": round(t_tok, 2), "total": round(elapsed, 2)},
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")

    print(f"corpus: {', '.join(args.sources)} (Python {manifest['python_version']}, {len(counts)} packages)")
    print(f"  train:   {len(train):6d} files {manifest['train_chars']:>12,d} chars {train_ids.size:>12,d} tokens")
    print(f"  heldout: {len(heldout):6d} files {manifest['heldout_chars']:>12,d} chars {heldout_ids.size:>12,d} tokens")
    print(f"  vocab {args.vocab_size}, {len(prompts)} prompts, {elapsed:.1f}s (read {t_read:.1f}, tokenizer "
          f"{t_tok:.1f}) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
