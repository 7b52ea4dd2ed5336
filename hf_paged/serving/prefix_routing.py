"""Prefix-aware replica choice: which engine replica most likely holds a request's prefix in its prefix cache.

Pure Python (no ray, no torch), so the policy is tested exactly; ``hf_paged.serving.ray_router`` plugs it into
Ray Serve's request router.

The key is text, not token ids: the ingress never loads a tokenizer or a model. A chat request is read as its
messages in order (role and text of each), a completion as its first prompt (text, or token ids written as
numbers). That text is cut into chunks of ``CHUNK_CHARS`` characters (``CHUNK_TOKENS`` ids for a token prompt),
about one KV block of 16 tokens each, and each chunk is hashed together with the hash of the chunks before it
(a hash chain, as the engine's block hashes are). Two requests share their first k chain hashes exactly when
their first k chunks are equal, which is when the replica that served one holds the other's first blocks. A
conversation's next turn repeats the earlier messages, so its chain extends the previous turn's.

:class:`PrefixTable` remembers, per chain hash, the replicas recently sent a request with it (bounded, least
recently used out), and :func:`rank_replicas` prefers the replica with the longest match unless it is much
busier than the least busy one (load-aware spill-over).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

CHUNK_CHARS = 64  # ~16 tokens of English text: about one KV block
CHUNK_TOKENS = 16
MAX_CHUNKS = 256  # the first 16 KiB of text decide; later text adds cost and no routing information
DEFAULT_TABLE_SIZE = 65536  # chain hashes remembered (each names a few replicas)


def routing_text(path: str, body: object) -> str | list[int] | None:
    """The text (or token ids) whose prefix routes a request to ``path``; None when it has none (not JSON,
    another route, no prompt): such a request goes to the least busy replica, and the replica reports any error."""
    if not isinstance(body, dict):
        return None
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                return None
            content = m.get("content")
            if isinstance(content, list):  # content parts: their text in order
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"<{m.get('role')}>{content if isinstance(content, str) else json.dumps(content)}")
        return "".join(parts)
    if path.endswith("/completions"):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # several prompts: the first decides
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
    return None


def prefix_hashes(key: str | Sequence[int] | None, max_chunks: int = MAX_CHUNKS) -> list[int]:
    """The hash chain of ``key``'s whole chunks (a shorter tail counts as a chunk too), first to last.

    Stable across processes (blake2b, not ``hash()``), so every router computes the same chain.
    """
    if not key:
        return []
    if isinstance(key, str):
        size = CHUNK_CHARS
        chunks = [key[i:i + size].encode("utf-8", "surrogatepass") for i in range(0, len(key), size)]
    else:
        size = CHUNK_TOKENS
        chunks = [",".join(map(str, key[i:i + size])).encode() for i in range(0, len(key), size)]
    hashes, previous = [], b""
    for chunk in chunks[:max_chunks]:
        previous = hashlib.blake2b(previous + chunk, digest_size=8).digest()
        hashes.append(int.from_bytes(previous, "little"))
    return hashes


class PrefixTable:
    """Chain hash -> replicas recently sent a request whose prefix has it (least recently used out).

    Args:
        capacity: Chain hashes kept; past it the least recently used go (a replica's own cache evicts too).
    """

    def __init__(self, capacity: int = DEFAULT_TABLE_SIZE) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity
        self._entries: OrderedDict[int, dict[Hashable, None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, hashes: Sequence[int]) -> dict[Hashable, int]:
        """Replica -> how many leading chunks of ``hashes`` it was sent (replicas with none are left out)."""
        depth: dict[Hashable, int] = {}
        alive: set[Hashable] | None = None
        for i, h in enumerate(hashes):
            holders = self._entries.get(h)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders.keys()
            if not alive:
                break
            for replica in alive:
                depth[replica] = i + 1
        return depth

    def insert(self, hashes: Iterable[int], replica: Hashable) -> None:
        for h in hashes:
            holders = self._entries.pop(h, None) or {}
            holders.pop(replica, None)
            holders[replica] = None  # newest holder last
            self._entries[h] = holders
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def remove(self, replica: Hashable) -> None:
        """Forget ``replica`` (it died or was removed: its replacement starts with an empty cache)."""
        for h in list(self._entries):
            holders = self._entries[h]
            holders.pop(replica, None)
            if not holders:
                del self._entries[h]


def _rendezvous(replica: Hashable, salt: int) -> int:
    """A per-(replica, key) score: ties among equals break the same way in every router."""
    data = f"{replica}:{salt}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def rank_replicas(
    replicas: Sequence[Hashable], hashes: Sequence[int], table: PrefixTable, loads: dict[Hashable, int], *,
    imbalance_factor: float = 2.0, imbalance_slack: int = 4,
) -> list[Hashable]:
    """``replicas`` best first for a request whose prefix chain is ``hashes``.

    A replica is *busy* when its ongoing requests exceed ``max(imbalance_factor * least, least + imbalance_slack)``
    (``least``: the least busy replica's count). Among the others the longest prefix match wins, then the lower
    load, then a rendezvous hash of the request's first chunk (so that equal replicas split new prefixes evenly
    and deterministically); busy replicas come last, least loaded first.
    """
    if not replicas:
        return []
    least = min(loads.get(r, 0) for r in replicas)
    limit = max(imbalance_factor * least, least + imbalance_slack)
    depth = table.match(hashes) if hashes else {}
    salt = hashes[0] if hashes else 0

    def key(r: Hashable) -> tuple:
        load = loads.get(r, 0)
        busy = load > limit
        return (busy, -depth.get(r, 0) if not busy else 0, load, -_rendezvous(r, salt))

    return sorted(replicas, key=key)
