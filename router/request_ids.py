"""Request ids: what a client sends is its own name for a request, never the cluster's.

`ActiveRequests` refuses a second live request under the same id from the same caller
(`DuplicateRequest`, ALREADY_EXISTS at the edge); requests of different callers may share an id.
`cluster_id` gives every request the id the actors know it by, unique among this router's live
requests and across routers (it names the router), whatever the client sent. Pure; one event loop.
"""

from __future__ import annotations

import collections
import itertools


class DuplicateRequest(Exception):
    """The same caller already has a live request under this id."""


class ActiveRequests:
    def __init__(self, router_id: str) -> None:
        self.router_id = router_id
        self._live: collections.Counter[tuple[str, str]] = collections.Counter()  # (caller, id) -> live
        self._numbers = itertools.count(1)

    def claim(self, client: str, request_id: str) -> str:
        """Register a live request; -> its cluster id. Raises DuplicateRequest when `client` already
        has one under `request_id`. Give it back with `release(client, request_id)`."""
        key = (client, request_id)
        if self._live[key]:
            raise DuplicateRequest(f"request_id {request_id!r} is already in use by a live request of this "
                                   "client; use a new id per request")
        self._live[key] += 1
        return self.cluster_id(request_id)

    def release(self, client: str, request_id: str) -> None:
        key = (client, request_id)
        self._live[key] -= 1
        if self._live[key] <= 0:
            del self._live[key]

    def cluster_id(self, request_id: str) -> str:
        """`request_id` made unique in the cluster: this router's name and a number of its own."""
        return f"{request_id}@{self.router_id}.{next(self._numbers)}"

    def __len__(self) -> int:
        return sum(self._live.values())
