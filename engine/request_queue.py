"""Waiting queues of the scheduler: FCFS (a deque) and priority (a heap)."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from splitserve.engine.request import Request


class RequestQueue(ABC):
    """The order in which waiting requests are considered for scheduling."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Enqueue a new request."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Re-enqueue a request that was already admitted once (preempted, KV loaded)."""

    @abstractmethod
    def peek(self) -> Request:
        """The next request to schedule."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the next request."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Remove a request from anywhere in the queue (abort)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue(RequestQueue):
    """Lower `priority` first, then earlier arrival; ties keep insertion order."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        key = (request.priority, request.arrival_time, next(self._counter), request)
        heapq.heappush(self._heap, key)

    prepend = add  # a preempted request keeps its (priority, arrival) rank

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))


def make_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r} (known: fcfs, priority)")
