"""Moving KV blocks between actors: one interface, NCCL on GPUs, gloo on CPUs, a fake for tests.

`base` holds the contract (spec, states, errors, the BlockStore protocol, KVSender/KVReceiver);
`sender`/`receiver` stream layers over any `link.Connector`; `fake` and `torch_dist` are the two
connectors. torch_dist is not imported here, so importing the package stays cheap.
"""

from tandem.kv_transfer.base import (BlockStore, KVReceiver, KVSender, KVTransferAborted, KVTransferConfig,
                              KVTransferError, KVTransferTimeout, TransferSpec, TransferState)
from tandem.kv_transfer.receiver import LayerStreamReceiver
from tandem.kv_transfer.sender import LayerStreamSender

__all__ = ["BlockStore", "KVReceiver", "KVSender", "KVTransferAborted", "KVTransferConfig",
           "KVTransferError", "KVTransferTimeout", "LayerStreamReceiver", "LayerStreamSender",
           "TransferSpec", "TransferState"]
