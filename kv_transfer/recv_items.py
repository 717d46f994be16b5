"""What a receive loop's threads hand each other, as named types: the frame reader's posted
receives (`PostedItem`) and queued direct copies (`CopiedItem`), expect()'s `PrepareItem`, and the
loop's record of each message until it has landed (`Landing`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tandem.kv_transfer.base import StagingRing
from tandem.kv_transfer.spec import TransferSpec
from tandem.kv_transfer.frames import LayersFrame
from tandem.kv_transfer.link import Pending
from tandem.kv_transfer.records import TransferRecord


class PrepareItem(NamedTuple):
    """expect() registered `spec`: build its destination block index while the loop is idle."""
    spec: TransferSpec


class PostedPart(NamedTuple):
    buf: torch.Tensor             # [part, *shape], in staging
    lease: StagingRing.Lease | None
    op: Pending                   # its receive


class PostedItem(NamedTuple):
    """A "layers" frame whose parts' receives the frame reader posted."""
    frame: LayersFrame
    posts: list[PostedPart]       # one per frame.parts, in order


class CopiedItem(NamedTuple):
    """A direct copy (and its ack) the frame reader queued."""
    rid: str
    rec: TransferRecord | None    # None: only acked (the transfer is gone or the frame did not fit)
    layers: list[int]             # copied; empty when only acked
    event: Any                    # CUDA: recorded after the copy and the ack
    read_at: float                # when the frame was read (the copy's clock starts there)


@dataclass
class Landing:
    """One posted message: its receive, then (once the data is there) its scatter."""
    rid: str
    rec: TransferRecord | None       # None: the data is received only to keep the link in step
    layers: list[int]                # to scatter and count; empty when the data is dropped
    op: Pending
    buf: torch.Tensor | None
    posted_at: float
    event: Any = None                # CUDA: recorded after the stream-ordered scatter
    claimed: bool = True             # holds a claim on the blocks (CPU: taken only to scatter)
    watched: bool = False            # the landing waiter thread wakes the loop when it is done
    lease: StagingRing.Lease | None = None   # its staging, free again once retired
    direct: bool = False             # copied straight out of the sender's cache (no scatter)
