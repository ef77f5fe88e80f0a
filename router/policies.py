"""Routing policies: pick one healthy instance of a role for a request.

- `round_robin`: the next one in turn; cheapest, fair when requests look alike.
- `least_loaded`: fewest requests queued or running (router's in-flight count and the instance's
  last /health), then most free KV blocks.
- `prefix_aware`: the instance that most likely holds this prompt's KV blocks in its prefix
  cache. The router has no tokenizer, so it hashes the prompt as it sees it: a chain of blake2b
  hashes over fixed-size chunks (`chunk_chars` characters of text, or `chunk_tokens` token ids),
  like the engine's block hashes but on the router's side. It remembers, for each chunk hash, the
  instance that last served it (bounded LRU). The instance with the longest matched chain wins,
  unless it is much busier than the least loaded one (`max_imbalance`), where the hit is worth
  less than the queueing.
"""

from __future__ import annotations

import hashlib
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any

from splitserve.router.registry import Instance


class RoutingPolicy(ABC):
    @abstractmethod
    def choose(self, instances: list[Instance], prompt: Any = None) -> Instance:
        """One of `instances` (non-empty, all healthy) for a request with this prompt."""

    def served(self, inst: Instance, prompt: Any = None) -> None:
        """Called after `inst` took the request (prefix_aware remembers it)."""
        return None


class RoundRobin(RoutingPolicy):
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, instances: list[Instance], prompt: Any = None) -> Instance:
        return instances[next(self._counter) % len(instances)]


class LeastLoaded(RoutingPolicy):
    def __init__(self) -> None:
        self._counter = itertools.count()  # breaks ties in turn, not always the first

    def choose(self, instances: list[Instance], prompt: Any = None) -> Instance:
        start = next(self._counter) % len(instances)
        rotated = instances[start:] + instances[:start]
        return min(rotated, key=lambda i: (i.load, -i.kv_blocks_free))


def prompt_chunk_hashes(prompt: Any, chunk_chars: int = 64, chunk_tokens: int = 16,
                        limit: int = 256) -> list[bytes]:
    """Chained hashes of the prompt's full chunks: h_i = H(h_{i-1}, chunk_i).

    A chat request's messages and a completion's text hash alike once flattened to text.
    """
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        data = [",".join(map(str, prompt[i:i + chunk_tokens])).encode()
                for i in range(0, len(prompt) - chunk_tokens + 1, chunk_tokens)]
    else:
        text = prompt if isinstance(prompt, str) else repr(prompt)
        raw = text.encode()
        data = [raw[i:i + chunk_chars] for i in range(0, len(raw) - chunk_chars + 1, chunk_chars)]
    hashes, prev = [], b""
    for chunk in data[:limit]:
        prev = hashlib.blake2b(prev + chunk, digest_size=16).digest()
        hashes.append(prev)
    return hashes


class PrefixAware(RoutingPolicy):
    def __init__(self, capacity: int = 100_000, max_imbalance: int = 8) -> None:
        self.capacity = capacity
        self.max_imbalance = max_imbalance
        self._owner: OrderedDict[bytes, str] = OrderedDict()  # chunk hash → instance url
        self._fallback = LeastLoaded()

    def match_length(self, url: str, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if self._owner.get(h) != url:
                break
            n += 1
        return n

    def choose(self, instances: list[Instance], prompt: Any = None) -> Instance:
        hashes = prompt_chunk_hashes(prompt) if prompt is not None else []
        least = self._fallback.choose(instances)
        if not hashes:
            return least
        best = max(instances, key=lambda i: (self.match_length(i.url, hashes), -i.load))
        if self.match_length(best.url, hashes) == 0:
            return least
        if best.load - least.load > self.max_imbalance:
            return least
        return best

    def served(self, inst: Instance, prompt: Any = None) -> None:
        if prompt is None:
            return
        for h in prompt_chunk_hashes(prompt):
            self._owner[h] = inst.url
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)


POLICIES: dict[str, type[RoutingPolicy]] = {
    "round_robin": RoundRobin, "least_loaded": LeastLoaded, "prefix_aware": PrefixAware,
}


def make_policy(name: str) -> RoutingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r} (known: {', '.join(POLICIES)})"
                         ) from None
