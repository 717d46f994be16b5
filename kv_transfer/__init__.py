"""Moving KV blocks between actors: one interface, NCCL on GPUs, gloo on CPUs, a fake for tests.

`base` holds the contract (spec, states, errors, the BlockStore protocol, KVSender/KVReceiver);
`sender`/`receiver` implement it over any `link.Connector`, one thread (`send_worker`) or loop
(`recv_loop`) per peer, each with two data paths picked per link: the direct copy out of a mapped
peer cache (`direct_send`, `direct_recv`) and the streamed path through the link (`streamed_send`,
`streamed_recv`); `frames` are the control frames. `fake` and `torch_dist` (with `dist_link`) are
the two connectors. torch_dist is not imported here, so importing the package stays cheap.
"""

from tandem.kv_transfer.base import (BlockStore, KVReceiver, KVSender, KVTransferAborted, KVTransferConfig,
                              KVTransferError, KVTransferTimeout, TransferSpec, TransferState)
from tandem.kv_transfer.receiver import LayerStreamReceiver
from tandem.kv_transfer.sender import LayerStreamSender

__all__ = ["BlockStore", "KVReceiver", "KVSender", "KVTransferAborted", "KVTransferConfig",
           "KVTransferError", "KVTransferTimeout", "LayerStreamReceiver", "LayerStreamSender",
           "TransferSpec", "TransferState"]
