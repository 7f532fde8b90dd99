"""A byte-level byte-pair-encoding tokenizer, small enough to read in one sitting.

Why our own: the demo must run without downloading anything, and a plain byte vocabulary
(V = 256) is too small for a fused loss to matter. Byte-pair encoding (Sennrich et al., 2016)
starts from the 256 byte values and repeatedly gives the most frequent adjacent pair of tokens a
new id, so the vocabulary grows to whatever size is asked for, as far as the corpus allows.

The text is first cut into pieces (a word with its leading space, a run of digits, one
punctuation mark, a run of whitespace), and merges never cross a piece boundary; learning stops
at the requested size or when no pair occurs twice. Ties between equally frequent pairs go to the
smaller pair of ids, so the result depends only on the text and the size.
"""

import heapq
import re
from collections import Counter

_PIECE = re.compile(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]|\s+")


def split_pieces(text):
    """The text cut into the pieces that merges never cross."""
    return _PIECE.findall(text)


class BytePairTokenizer:
    """`merges[k]` is the pair of ids that id 256 + k stands for."""

    def __init__(self, merges):
        self.merges = [tuple(m) for m in merges]
        self._rank = {pair: k for k, pair in enumerate(self.merges)}
        self._bytes = [bytes([b]) for b in range(256)]
        for a, b in self.merges:
            self._bytes.append(self._bytes[a] + self._bytes[b])
        self._cache = {}

    @property
    def vocab_size(self):
        return 256 + len(self.merges)

    @classmethod
    def train(cls, text, vocab_size):
        """Learns up to `vocab_size - 256` merges from `text`."""
        if vocab_size < 256:
            raise ValueError(f"vocab_size must be at least 256 (the byte values), got {vocab_size}")
        counts = Counter(split_pieces(text))
        words = [list(w.encode("utf-8")) for w in counts]
        freq = list(counts.values())
        pair_count = Counter()
        where = {}  # pair -> indices of the words that contain it (may hold stale entries)
        for i, w in enumerate(words):
            for pair in zip(w, w[1:]):
                pair_count[pair] += freq[i]
                where.setdefault(pair, set()).add(i)
        heap = [(-c, pair) for pair, c in pair_count.items()]
        heapq.heapify(heap)
        merges = []
        while len(merges) < vocab_size - 256 and heap:
            neg, pair = heapq.heappop(heap)
            if pair_count.get(pair, 0) != -neg:
                continue  # stale entry: the count changed since it was pushed
            if -neg < 2:
                break
            new_id = 256 + len(merges)
            merges.append(pair)
            changed = set()
            for i in where.pop(pair, ()):
                w, f = words[i], freq[i]
                merged = _merge(w, pair, new_id)
                if len(merged) == len(w):
                    continue
                for p in zip(w, w[1:]):
                    pair_count[p] -= f
                    changed.add(p)
                for p in zip(merged, merged[1:]):
                    pair_count[p] += f
                    where.setdefault(p, set()).add(i)
                    changed.add(p)
                words[i] = merged
            pair_count.pop(pair, None)
            changed.discard(pair)
            for p in changed:
                c = pair_count.get(p, 0)
                if c > 0:
                    heapq.heappush(heap, (-c, p))
                else:
                    pair_count.pop(p, None)
        return cls(merges)

    def _encode_piece(self, piece):
        ids = self._cache.get(piece)
        if ids is None:
            ids = list(piece.encode("utf-8"))
            while len(ids) > 1:
                best = min(zip(ids, ids[1:]), key=lambda p: self._rank.get(p, len(self._rank)))
                if best not in self._rank:
                    break
                ids = _merge(ids, best, 256 + self._rank[best])
            self._cache[piece] = ids
        return ids

    def encode(self, text):
        """The ids of `text`, piece by piece."""
        out = []
        for piece in split_pieces(text):
            out.extend(self._encode_piece(piece))
        return out

    def decode(self, ids):
        """The text of `ids`; bytes that do not form valid UTF-8 become U+FFFD."""
        return b"".join(self._bytes[i] for i in ids).decode("utf-8", errors="replace")


def _merge(ids, pair, new_id):
    """`ids` with every non-overlapping occurrence of `pair`, left to right, replaced by `new_id`."""
    out, i, n = [], 0, len(ids)
    while i < n:
        if i + 1 < n and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out
