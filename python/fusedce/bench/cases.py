"""What to measure: the problem shapes (from real models), and the --shapes syntax.

A cross-entropy case is N tokens x V vocabulary over given logits; a linear cross-entropy case is
N tokens x H hidden x V vocabulary (the loss of hidden @ weight.T); a log-probability case has the
linear shape and measures the per-token log-probabilities (and entropy) of hidden @ weight.T, as
a reinforcement-learning step needs them. A masked case ignores half of the targets, as a
prompt-masked fine-tuning batch does: the first half of every sequence.
"""

import dataclasses

import torch

# Vocabularies of real models, and a model that has each (for the table's "model" column).
VOCABS = {
    32000: "Llama 2 / Mistral 7B",
    50257: "GPT-2",
    128256: "Llama 3",
    151936: "Qwen 2.5 / 3",
    262144: "Gemma 3",
}

# Models whose LM head is hidden x vocab, for the linear cases.
HEADS = {
    (2048, 128256): "Llama 3.2 1B",
    (4096, 128256): "Llama 3.1 8B",
    (2048, 151936): "Qwen 3 1.7B",
    (4096, 151936): "Qwen 3 8B",
    (4096, 32000): "Mistral 7B",
    (2048, 50257): "GPT-2 vocab, 2048 wide",
    (2048, 262144): "Gemma 3 vocab, 2048 wide",
}

MASK_FRACTION = 0.5
SEQUENCE = 2048  # tokens per sequence of a masked batch; its first half is the prompt


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem: kind 'ce' (tokens x vocab logits), 'linear' (tokens x hidden x vocab),
    'logprobs' (the same shape, per-token log-probabilities) or 'shard' (the same shape, split
    by vocabulary over W ranks: bench/shard.py)."""

    kind: str
    tokens: int
    vocab: int
    hidden: int = 0
    masked: bool = False

    @property
    def model(self):
        if self.kind in ("linear", "logprobs", "shard"):
            return HEADS.get((self.hidden, self.vocab), "")
        return VOCABS.get(self.vocab, "")

    @property
    def label(self):
        dims = (self.tokens, self.vocab) if self.kind == "ce" else (self.tokens, self.hidden, self.vocab)
        return (" x ".join(str(d) for d in dims) + (" logprobs" if self.kind == "logprobs" else "")
                + (" masked" if self.masked else ""))


def _ce(tokens, vocab, masked=False):
    return Case("ce", tokens, vocab, 0, masked)


def _lin(tokens, hidden, vocab, masked=False):
    return Case("linear", tokens, vocab, hidden, masked)


def _lp(tokens, hidden, vocab, masked=False):
    return Case("logprobs", tokens, vocab, hidden, masked)


def default_cases(device, quick):
    """The grid for a device. GPU: every vocabulary at 8192 tokens (the bandwidth-vs-vocabulary
    plot), 1K and 32K tokens at 128256, a masked batch; linear: tokens 1K..32K through the
    Llama 3.1 8B head (the time/memory-vs-tokens plot), each other head at 8192 tokens, a masked
    batch; log-probabilities through the Qwen 3 8B head (an RL policy's) at 2K..16K tokens and the
    Gemma 3 vocabulary at 8192. CPU: the same kinds of rows at sizes that finish in a few minutes on
    two cores (128 tokens over every vocabulary; 16 to 64 tokens through a 1024 x 32000 head).
    quick: a few rows of each kind (seconds on a CPU)."""
    if device == "cuda":
        if quick:
            return ([_ce(8192, v) for v in (32000, 128256, 262144)] + [_ce(8192, 128256, True)]
                    + [_lin(n, 4096, 128256) for n in (2048, 8192)] + [_lin(8192, 4096, 128256, True)]
                    + [_lp(8192, 4096, 151936)])
        ce = [_ce(8192, v) for v in VOCABS] + [_ce(1024, 128256), _ce(32768, 128256), _ce(8192, 128256, True)]
        linear = [_lin(n, 4096, 128256) for n in (1024, 2048, 4096, 8192, 16384, 32768)]
        linear += [_lin(8192, h, v) for (h, v) in HEADS if (h, v) != (4096, 128256)]
        linear += [_lin(8192, 4096, 128256, True)]
        logprobs = [_lp(n, 4096, 151936) for n in (2048, 8192, 16384)] + [_lp(8192, 2048, 262144)]
        return ce + linear + logprobs
    if quick:
        return [_ce(64, 32000), _ce(64, 50257, True), _lin(32, 256, 32000), _lin(64, 256, 32000, True),
                _lp(32, 256, 32000)]
    ce = [_ce(128, v) for v in VOCABS] + [_ce(128, 128256, True)]
    linear = [_lin(n, 1024, 32000) for n in (16, 32, 64)] + [_lin(64, 1024, 32000, True)]
    return ce + linear + [_lp(64, 1024, 32000)]


def parse_shapes(text):
    """--shapes: comma-separated NxV (cross-entropy over logits) or NxHxV (linear cross-entropy),
    each optionally followed by ':masked' (half of the targets ignored); NxHxV:logprobs for the
    per-token log-probabilities of that head (':logprobs:masked' both)."""
    cases = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        spec, *flags = item.split(":")
        if not set(flags) <= {"masked", "logprobs"} or len(set(flags)) != len(flags):
            raise ValueError(f"--shapes: {item!r}: the suffixes are ':masked' and ':logprobs'")
        try:
            dims = [int(d) for d in spec.lower().split("x")]
        except ValueError:
            raise ValueError(f"--shapes: {item!r} is not NxV or NxHxV (positive integers)") from None
        if len(dims) not in (2, 3) or min(dims) < 1:
            raise ValueError(f"--shapes: {item!r} is not NxV or NxHxV (positive integers)")
        masked = "masked" in flags
        if "logprobs" in flags:
            if len(dims) != 3:
                raise ValueError(f"--shapes: {item!r}: ':logprobs' takes NxHxV")
            cases.append(_lp(*dims, masked))
        else:
            cases.append(_ce(dims[0], dims[1], masked) if len(dims) == 2 else _lin(*dims, masked))
    if not cases:
        raise ValueError("--shapes: no shape given")
    return cases


def ignored_mask(tokens, device):
    """The rows a masked case ignores: the first half of every SEQUENCE-token sequence (the
    prompt), or of the whole batch when it is shorter than one sequence."""
    seq = min(SEQUENCE, tokens)
    return torch.arange(tokens, device=device) % seq < int(seq * MASK_FRACTION)
