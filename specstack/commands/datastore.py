"""``specstack datastore build CORPUS... -o STORE``: tokenize a corpus into a REST datastore."""

from __future__ import annotations

import sys
from pathlib import Path

from ..retrieval.datastore import Datastore, build_from_files
from ..errors import SpecstackError
from ..paths import DEFAULT_TARGET
from ..ui import fmt_bytes, table


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "datastore",
        help="build and inspect REST datastores (static corpora for the rest drafter)",
        description="A datastore is a tokenized corpus with a suffix array, memory-mapped by the "
        "rest drafter (--drafter rest --datastore STORE).",
    )
    sub = p.add_subparsers(dest="datastore_command", metavar="ACTION")
    b = sub.add_parser(
        "build",
        help="tokenize text files or folders into a datastore",
        description="Tokenize CORPUS files and folders (recursively; binary and non-UTF-8 files "
        "are skipped) with MODEL's tokenizer and write a datastore to STORE. Rebuilding with "
        "unchanged inputs does nothing.",
    )
    b.add_argument("corpus", nargs="+", help="text files or folders to index")
    b.add_argument("-m", "--model", default=str(DEFAULT_TARGET),
                   help="GGUF whose tokenizer to use: the target the store will serve "
                   "(default: bundled pycoder-6m)")
    b.add_argument("-o", "--output", required=True, metavar="STORE", help="datastore folder to write")
    b.add_argument("--include", action="append", default=[], metavar="GLOB",
                   help="only index files in folders whose name matches GLOB (e.g. '*.py'; repeatable)")
    b.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="skip files whose path relative to their corpus folder matches GLOB (repeatable)")
    b.add_argument("--exclude-from", action="append", default=[], metavar="FILE",
                   help="skip the relative paths or globs listed in FILE, one per line (e.g. held-out "
                   "benchmark files)")
    b.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="stop adding files once the store would pass N tokens")
    b.add_argument("--force", action="store_true", help="rebuild even if the store is up to date")
    b.set_defaults(func=run_build)
    i = sub.add_parser("info", help="print a datastore's meta data",
                       description="Check a datastore and print its size and origin.")
    i.add_argument("store", help="datastore folder")
    i.set_defaults(func=run_info)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _read_excludes(files: list[str]) -> list[str]:
    out = []
    for f in files:
        try:
            lines = Path(f).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise SpecstackError(f"cannot read --exclude-from {f}: {exc.strerror}") from None
        out += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    return out


def load_tokenizer(model: str):
    """A vocab-only llama.cpp model: tokenizes without loading weights."""
    from ..modelfile.meta import read_gguf
    from ..llama import VocabModel

    llm = VocabModel(model)
    info = read_gguf(llm.path, tensors=False)
    meta = {"model": str(Path(llm.path).resolve()), "fingerprint": info.vocab_fingerprint, "n_vocab": llm.n_vocab}
    return llm, meta


def run_build(args) -> int:
    if args.max_tokens is not None and args.max_tokens < 1:
        raise SpecstackError(f"--max-tokens must be >= 1 (got {args.max_tokens})")
    llm, tok_meta = load_tokenizer(args.model)

    def tokenize(text: str) -> list[int]:
        return llm.tokenize(text, add_special=False)

    result = build_from_files(
        args.corpus,
        Path(args.output).expanduser(),
        tokenize,
        n_vocab=tok_meta["n_vocab"],
        tokenizer=tok_meta,
        include=args.include,
        exclude=args.exclude + _read_excludes(args.exclude_from),
        max_tokens=args.max_tokens,
        force=args.force,
    )
    if not result.skipped:
        meta = result.meta
        print(f"wrote {result.path}: {meta['n_tokens']} tokens from {meta['n_docs']} files, "
              f"{fmt_bytes(_size(result.path))}, in {result.seconds:.1f}s", file=sys.stderr)
    return 0


def run_info(args) -> int:
    store = Datastore(Path(args.store).expanduser())
    m = store.meta
    tok = m.get("tokenizer") or {}
    print(f"datastore {store.path}")
    print(table([], [["tokens", f"{m['n_tokens']} in {m['n_docs']} documents ({fmt_bytes(_size(store.path))})"],
                     ["tokenizer", f"{tok.get('model')} (vocab {m['n_vocab']}, fingerprint {str(tok.get('fingerprint'))[:12]})"],
                     ["built", m.get("created")]], align="ll", indent="  ", sep="   "))
    return 0


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir())
