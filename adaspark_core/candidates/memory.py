"""The n-gram memory: what the model said in earlier requests, a candidate source across requests.

Without a model drafter, candidates come only from the request's own text, and most rounds then
have none. Models repeat themselves across requests (openings, formats, idioms, a conversation's
phrases turn after turn), so the committed replies of earlier requests, and optionally a user's
corpus (``adaspark store memorize``), are kept here, like llama.cpp's dynamic and static n-gram
caches. The fill (ngram.py) reads a chain from the memory where the request's own text has no
copy to offer; its nodes are n-gram nodes of kind ``memory``, priced by their own buckets in the
acceptance model, so they are verified only where their own record says they pay.

Layout: ``tokens`` is every kept document, each preceded by SEP (-1, which no token equals, so no
match runs across two documents). The index is two numpy arrays sorted together, the hash of
every GRAM-token gram that has a follower in its document, and the end position of that gram:
for one gram, its occurrences sit side by side, oldest first. It is kept in two runs of that
layout: the main one and a small recent one that every new document goes into, merged into the
main run once it holds RECENT_MAX grams (every recent end is past every main one, so the merge is
the order a single run would have), so adding a reply moves the small run only (ARCHITECTURE.md,
section 5: the two runs). A lookup hashes the
context's last GRAM tokens (a binary search in each run), checks the newest SCAN occurrences
token by token (a hash may collide) and extends each match backwards; the longest wins, ties to
the newest. A chain then reads on along the memory without further lookups.

Size: ``cap_mb`` bounds the memory in RAM (tokens and index: BYTES_PER_TOKEN per token). When a
new document takes it over the cap, the oldest documents are dropped until it is at 3/4 of the cap
(first in, first out: old replies are the least likely to be said again; dropping a quarter at a
time keeps the index rebuild, which eviction needs, rare).

On disk: one file beside the store (``<store>.memory``), written atomically whenever the store is
saved after the memory changed (between a server's replies a slow write is spaced out,
decode/runtime.py ``MEMORY_EVERY_S``): a header line (magic), a JSON line (version, the store's
fingerprint key, counts), the tokens as little-endian int32, then the CRC32 of every byte before
it (4 bytes, little-endian). The index is rebuilt on load. A file that does not parse, or whose
checksum does not match, is reported and left as is, like a bad store (memory_file.py
reads and writes it): without the checksum a flipped byte that leaves a valid token id would be
read silently, and the fill would propose the wrong token at that place for as long as the memory
keeps it. CRC32 rather than a cryptographic hash: it catches every burst of up to 32 flipped bits
for certain, and at some 3.6 GB/s (zlib, measured) a file at the 64 MB cap, whose tokens take
12.8 MB, costs about 4 ms to write or read. Version 1 files, written before the checksum, are read
as they were, and written as version 2 at the next save.
"""

from __future__ import annotations

import math
import zlib
from array import array

import numpy as np
import orjson

from adaspark_core.base.tree import COPY_MIN

SEP = -1
GRAM = COPY_MIN  # tokens a lookup matches at least, as a copy from the request's own text does
SCAN = 8  # newest occurrences of a gram compared per lookup
RECENT_MAX = 1 << 16  # grams in the recent run before it merges into the main one (about 650 replies of 100 tokens)
DEFAULT_CAP_MB = 64.0
BYTES_PER_TOKEN = 4 + 8 + 8  # the token (int32), its gram's hash (uint64) and end (int64)
MAGIC = b"ADASPARK-NGRAM-MEMORY\n"
VERSION = 2  # 2 added the checksum
READS = (1, 2)  # the versions read: 1 has no checksum
CHECKSUM_BYTES = 4  # the CRC32 after the tokens (version 2)
MAX_HEAD = 4096  # bytes of the header line (a few counts: a few hundred)
MAX_FILE_BYTES = 1 << 36  # a file to inspect, whatever cap it was written under (64 GB)
MAX_CORPUS_BYTES = 256 << 20  # a text file to memorize: ~60M tokens, some 20 times a 64 MB cap's worth
_B = 1_000_003  # the gram hash's base (arithmetic mod 2^64)
_MASK = (1 << 64) - 1


class MemoryFileError(ValueError):
    """A memory file that cannot be read (the message names it)."""


def gram_hash(gram) -> int:
    """The hash of GRAM tokens, as ``_hashes`` computes it for a whole array."""
    h = 0
    for t in gram:
        h = (h * _B + t) & _MASK
    return h


def _hashes(doc: np.ndarray) -> np.ndarray:
    """The hash of every GRAM-gram of ``doc`` that has a follower in it (ends 3 .. n-2)."""
    n = len(doc)
    if n < GRAM + 1:
        return np.empty(0, np.uint64)
    d = doc.astype(np.uint64)
    h = np.zeros(n - GRAM, np.uint64)
    for i in range(GRAM):  # uint64 arithmetic wraps, as gram_hash's mask does
        h = h * np.uint64(_B) + d[i : n - GRAM + i]
    return h


def _merged(keys: np.ndarray, ends: np.ndarray, new_keys: np.ndarray, new_ends: np.ndarray):
    """A run with sorted grams added, every new end past every old one: each goes to the right of
    its equal keys, so a gram's occurrences stay oldest first."""
    at = np.searchsorted(keys, new_keys, side="right")
    return np.insert(keys, at, new_keys), np.insert(ends, at, new_ends)


class NgramMemory:
    def __init__(self, cap_mb: float = DEFAULT_CAP_MB):
        if not cap_mb > 0:
            raise ValueError("the memory's cap must be positive")
        self.cap_mb = cap_mb
        self.tokens = array("i")
        self._keys = np.empty(0, np.uint64)  # the main run
        self._ends = np.empty(0, np.int64)
        self._rkeys = np.empty(0, np.uint64)  # the recent run
        self._rends = np.empty(0, np.int64)
        self.documents = 0
        self.evicted = 0  # tokens dropped by the cap since the memory began
        # How it did (store show): lookups and those that found a continuation; memory nodes
        # verified and accepted.
        self.lookups = 0
        self.found = 0
        self.rows = 0
        self.accepted = 0
        self.dirty = False

    # --- adding -----------------------------------------------------------------------------

    def add(self, tokens: list[int]) -> None:
        """Keep one document (a reply, a corpus chunk). Too short to hold a gram and a follower:
        nothing is kept."""
        if len(tokens) < GRAM + 1:
            return
        doc = np.asarray(tokens, dtype=np.int64)
        if doc.min() < 0 or doc.max() > np.iinfo(np.int32).max:
            raise ValueError("token ids must be non-negative int32")
        start = len(self.tokens) + 1  # after the separator
        self.tokens.append(SEP)
        self.tokens.extend(doc.astype(np.int32).tolist())
        keys = _hashes(doc)
        ends = np.arange(start + GRAM - 1, start + len(doc) - 1, dtype=np.int64)
        order = np.argsort(keys, kind="stable")  # equal keys keep position order
        self._rkeys, self._rends = _merged(self._rkeys, self._rends, keys[order], ends[order])
        if len(self._rkeys) >= RECENT_MAX:
            self._keys, self._ends = self.index()
            self._rkeys, self._rends = np.empty(0, np.uint64), np.empty(0, np.int64)
        self.documents += 1
        self.dirty = True
        if self.nbytes > self.cap_mb * 1e6:
            self._evict(0.75 * self.cap_mb * 1e6)

    def add_many(self, documents: list[list[int]]) -> None:
        """Keep many documents (a corpus): as ``add`` one by one, with one index rebuild."""
        kept = [d for d in documents if len(d) >= GRAM + 1]
        for doc in kept:
            if min(doc) < 0:
                raise ValueError("token ids must be non-negative int32")
            self.tokens.append(SEP)
            self.tokens.extend(doc)
        if kept:
            self._reindex()
            self.dirty = True
            if self.nbytes > self.cap_mb * 1e6:
                self._evict(0.75 * self.cap_mb * 1e6)

    def _evict(self, target_bytes: float) -> None:
        """Drop the oldest documents until the memory takes at most ``target_bytes``."""
        toks = np.frombuffer(self.tokens, dtype=np.int32)
        keep_from = len(toks) - int(target_bytes // BYTES_PER_TOKEN)
        seps = np.flatnonzero(toks == SEP)
        later = seps[seps >= max(keep_from, 1)]
        cut = int(later[0]) if len(later) else len(toks)  # a document boundary
        kept = toks[cut:].copy()
        self.evicted += cut
        self.tokens = array("i", kept.tobytes())
        self._reindex()

    def _reindex(self) -> None:
        toks = np.frombuffer(self.tokens, dtype=np.int32).astype(np.int64)
        seps = np.flatnonzero(toks == SEP).tolist() + [len(toks)]
        keys, ends = [], []
        for a, b in zip(seps, seps[1:]):
            doc = toks[a + 1 : b]
            keys.append(_hashes(doc))
            ends.append(np.arange(a + GRAM, a + len(doc), dtype=np.int64))
        keys = np.concatenate(keys) if keys else np.empty(0, np.uint64)
        ends = np.concatenate(ends) if ends else np.empty(0, np.int64)
        order = np.lexsort((ends, keys))
        self._keys, self._ends = keys[order], ends[order]
        self._rkeys, self._rends = np.empty(0, np.uint64), np.empty(0, np.int64)
        self.documents = len(seps) - 1

    def index(self) -> tuple[np.ndarray, np.ndarray]:
        """The index as one run (keys, ends): the main run with the recent one merged in."""
        return _merged(self._keys, self._ends, self._rkeys, self._rends)

    # --- reading ----------------------------------------------------------------------------

    def lookup(self, tail: tuple[int, ...]) -> tuple[int, int, int] | None:
        """The memory's continuation of a text ending in ``tail`` (its last MAX_MATCH tokens or
        fewer): ``(token, match length, position of the token)`` for the longest match of at
        least GRAM tokens among the newest SCAN occurrences of its last gram, or None."""
        if len(tail) < GRAM or not (len(self._keys) or len(self._rkeys)):
            return None
        self.lookups += 1
        key = np.uint64(gram_hash(tail[-GRAM:]))
        toks = self.tokens
        best_len, best_end = 0, -1
        n = len(tail)
        left = SCAN
        for keys, ends in ((self._rkeys, self._rends), (self._keys, self._ends)):  # newest first
            i = int(np.searchsorted(keys, key, side="right")) - 1
            while left and i >= 0 and keys[i] == key and best_len < n:
                e = int(ends[i])
                m = 0
                while m < n and toks[e - m] == tail[n - 1 - m]:  # SEP ends a match at the document's start
                    m += 1
                if m > best_len:
                    best_len, best_end = m, e
                left -= 1
                i -= 1
        if best_len < GRAM:
            return None
        self.found += 1
        return toks[best_end + 1], best_len, best_end + 1

    def read_on(self, p: int) -> int | None:
        """The token after position ``p`` in its document, or None at the document's end."""
        if p + 1 >= len(self.tokens):
            return None
        t = self.tokens[p + 1]
        return None if t == SEP else t

    def note(self, rows: int, accepted: int) -> None:
        """Count a round's memory nodes, verified and accepted (for store show; saved with the
        next document, not on their own)."""
        self.rows += rows
        self.accepted += accepted

    # --- size and report --------------------------------------------------------------------

    @property
    def n_tokens(self) -> int:
        return len(self.tokens) - self.documents  # separators are not tokens

    @property
    def nbytes(self) -> int:
        return len(self.tokens) * 4 + self._keys.nbytes + self._ends.nbytes + self._rkeys.nbytes + self._rends.nbytes

    def summary(self) -> dict:
        keys, _ = self.index()
        return {
            "documents": self.documents, "tokens": self.n_tokens, "ngrams": len(keys),
            "distinct_ngrams": int(len(np.unique(keys))) if len(keys) else 0,
            "mb": self.nbytes / 1e6, "cap_mb": self.cap_mb if math.isfinite(self.cap_mb) else None,
            "evicted_tokens": self.evicted,
            "lookups": self.lookups, "hit_rate": self.found / self.lookups if self.lookups else None,
            "rows": self.rows, "accepted": self.accepted,
            "acceptance": self.accepted / self.rows if self.rows else None,
        }

    # --- the file ---------------------------------------------------------------------------

    def to_bytes(self, owner: str) -> bytes:
        head = {"version": VERSION, "owner": owner, "documents": self.documents, "size": len(self.tokens),
                "evicted": self.evicted, "lookups": self.lookups, "found": self.found, "rows": self.rows,
                "accepted": self.accepted}
        front = MAGIC + orjson.dumps(head) + b"\n"
        tokens = np.frombuffer(self.tokens, np.int32).astype("<i4").tobytes()
        crc = zlib.crc32(tokens, zlib.crc32(front))
        return b"".join((front, tokens, crc.to_bytes(CHECKSUM_BYTES, "little")))

    @classmethod
    def from_bytes(cls, raw: bytes, owner: str, cap_mb: float = DEFAULT_CAP_MB,
                   n_vocab: int | None = None) -> "NgramMemory":
        """The memory a file holds; MemoryFileError saying what is wrong, or whose it is not. A
        version 2 file's checksum is checked before anything the header says is believed (a
        flipped byte in the owner or a count would otherwise be reported as what it is not). Every
        token must be in the model's vocabulary (``n_vocab``, when known): a version 1 file has no
        checksum, and a token out of it would become a candidate the engine cannot decode."""
        if not raw.startswith(MAGIC):
            raise MemoryFileError("not an AdaSpark n-gram memory")
        nl = raw.find(b"\n", len(MAGIC), len(MAGIC) + MAX_HEAD)
        try:
            head = orjson.loads(raw[len(MAGIC) : nl]) if nl >= 0 else None
        except orjson.JSONDecodeError:
            head = None
        if not isinstance(head, dict):
            raise MemoryFileError("its header is not a JSON object")
        version = head.get("version")
        if isinstance(version, bool) or version not in READS:
            raise MemoryFileError(f"version {version!r} (this AdaSpark reads {', '.join(map(str, READS))})")
        data = memoryview(raw)[nl + 1 :]  # a view: the tokens are copied once, into the memory
        if version >= 2:
            if len(data) < CHECKSUM_BYTES:
                raise MemoryFileError("it is damaged: it ends before its checksum (a cut file)")
            stored = int.from_bytes(data[-CHECKSUM_BYTES:], "little")
            crc = zlib.crc32(memoryview(raw)[:-CHECKSUM_BYTES])
            if crc != stored:
                raise MemoryFileError(f"it is damaged: checksum {crc:08x}, where the file says {stored:08x} "
                                      f"(a changed or cut file)")
            data = data[:-CHECKSUM_BYTES]
        if head.get("owner") != owner:
            raise MemoryFileError("it belongs to another model, drafter or machine than its store")
        counts = ("documents", "size", "evicted", "lookups", "found", "rows", "accepted")
        if not all(isinstance(head.get(k), int) and head[k] >= 0 for k in counts) or len(data) != 4 * head["size"]:
            raise MemoryFileError("its counts do not match its contents (a cut or edited file)")
        toks = np.frombuffer(data, dtype="<i4")
        if len(toks) and (toks[0] != SEP or toks.min() < SEP or int((toks == SEP).sum()) != head["documents"]):
            raise MemoryFileError("its tokens are not documents separated as written")
        if n_vocab is not None and len(toks) and int(toks.max()) >= n_vocab:
            raise MemoryFileError(f"it holds token id {int(toks.max())}, outside the model's vocabulary of "
                                  f"{n_vocab} (a damaged file)")
        m = cls(cap_mb)
        m.tokens = array("i", toks.astype(np.int32).tobytes())
        for k in ("evicted", "lookups", "found", "rows", "accepted"):
            setattr(m, k, head[k])
        m._reindex()
        return m
