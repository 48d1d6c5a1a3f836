"""The training text of the tiny default model: the Python standard library's own source files.

Every machine with Python has them, so nothing is downloaded. The corpus is every `*.py` under
`sysconfig.get_paths()["stdlib"]`, sorted by path, without installed packages (`site-packages`,
`dist-packages`), test suites (`test`, `tests`, `idle_test` folders, which some distributions and the
official Docker images strip anyway) and the generated codec tables of `encodings/` (12% of the bytes,
not Python as people write it). Which modules are held out for validation is fixed by name
(`HELD_OUT`, ~5% of the bytes, present in 3.11 through 3.13), so the split depends only on the files.
The files differ between Python versions: `corpus_fingerprint` names the version and a digest of the
files, and the training card records it.

The tokenizer is a byte-level BPE (as models/tiny.py builds one) trained on the training split only;
one trained on Python 3.11's stdlib ships as tools/tiny_tokenizer.json, so a run on another Python
uses the same vocabulary (any text encodes: the BPE is byte-level).
"""

from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.tiny import SPECIAL_TOKENS

EXCLUDED_DIRS = ("test", "tests", "idle_test")
EXCLUDED_TOP = ("site-packages", "dist-packages", "encodings")
# top-level modules / packages held out for validation: general-purpose code of every style
HELD_OUT = (
    "argparse", "calendar", "configparser", "csv", "difflib", "fractions", "gettext", "heapq", "json", "shlex",
    "statistics", "string", "textwrap", "tomllib",
)
VOCAB_SIZE = 4096
SHIPPED_TOKENIZER = Path(__file__).with_name("tiny_tokenizer.json")


@dataclass(frozen=True)
class SourceFile:
    module: str  # dotted name relative to the stdlib root ("json.decoder", "json" for json/__init__.py)
    path: Path

    @property
    def top(self) -> str:
        return self.module.split(".")[0]

    @property
    def held_out(self) -> bool:
        return self.top in HELD_OUT

    def text(self) -> str:
        return self.path.read_text(encoding="utf-8", errors="replace")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[SourceFile]:
    """The corpus files, sorted by path relative to `root` (default: this interpreter's stdlib)."""
    root = root or stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        parts = path.relative_to(root).parts
        if parts[0] in EXCLUDED_TOP or any(part in EXCLUDED_DIRS for part in parts[:-1]):
            continue
        names = list(parts[:-1]) + ([] if parts[-1] == "__init__.py" else [parts[-1][:-3]])
        out.append(SourceFile(".".join(names), path))
    return out


def split(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """(training files, held-out files), each in corpus order."""
    return [f for f in files if not f.held_out], [f for f in files if f.held_out]


def corpus_fingerprint(files: list[SourceFile]) -> dict:
    """What the corpus was: Python version, file and byte counts per split, a digest of names and bytes."""
    digest = hashlib.sha256()
    counts = {"train": [0, 0], "held_out": [0, 0]}
    for f in files:
        data = f.path.read_bytes()
        digest.update(f.module.encode() + b"\0" + data + b"\0")
        side = counts["held_out" if f.held_out else "train"]
        side[0] += 1
        side[1] += len(data)
    return {
        "python": platform.python_version(),
        "stdlib": str(stdlib_root()),
        "files": {k: v[0] for k, v in counts.items()},
        "bytes": {k: v[1] for k, v in counts.items()},
        "sha256": digest.hexdigest(),
    }


def train_tokenizer(files: list[SourceFile], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE of `vocab_size` ids (SPECIAL_TOKENS first) on the files' text, deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((f.text() for f in files), trainer=trainer)
    return tokenizer


def load_tokenizer(path: Path = SHIPPED_TOKENIZER):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def encode_files(tokenizer, files: list[SourceFile], eos_id: int) -> np.ndarray:
    """One int32 stream: each file's tokens followed by the end-of-sentence id, in corpus order."""
    encodings = tokenizer.encode_batch([f.text() for f in files], add_special_tokens=False)
    pieces = []
    for encoding in encodings:
        pieces.append(np.asarray(encoding.ids, dtype=np.int32))
        pieces.append(np.asarray([eos_id], dtype=np.int32))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def file_starts(stream: np.ndarray, eos_id: int) -> np.ndarray:
    """Offsets in `stream` where a file begins (0 and after every end-of-sentence id but the last)."""
    ends = np.flatnonzero(stream == eos_id) + 1
    return np.concatenate([[0], ends[:-1]]).astype(np.int64)


def main() -> None:
    """Trains the shipped tokenizer on this interpreter's stdlib: python -m tools.stdlib_corpus."""
    files = stdlib_files()
    train, _ = split(files)
    train_tokenizer(train).save(str(SHIPPED_TOKENIZER))
    meta = {"vocab_size": VOCAB_SIZE, "trained_on": corpus_fingerprint(files)}
    SHIPPED_TOKENIZER.with_suffix(".meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(SHIPPED_TOKENIZER, meta)


if __name__ == "__main__":
    main()
