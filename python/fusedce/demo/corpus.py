"""The demo's training text (shipped in fusedce/data, see its README.md) and its tokenisation."""

from pathlib import Path

from .tokenizer import BytePairTokenizer

CORPUS_PATH = Path(__file__).resolve().parent.parent / "data" / "tiny_shakespeare.txt"


def load_text(path=None):
    """The corpus as one string (UTF-8)."""
    path = Path(path) if path is not None else CORPUS_PATH
    if not path.is_file():
        raise FileNotFoundError(f"corpus not found at {path} (is the package data installed?)")
    return path.read_text(encoding="utf-8")


def tokenize(text, vocab):
    """A tokenizer with at most `vocab` ids learned on `text`, and the ids of `text`.

    The model's vocabulary is `vocab` in any case: when the text cannot supply that many merges
    (a few hundred KB supports about 7,000), the ids the tokenizer never emits stay unused. They
    cost the loss exactly what used ids cost, which is what the demo measures; the model soon
    learns never to predict them.
    """
    tok = BytePairTokenizer.train(text, vocab)
    return tok, tok.encode(text)
