"""Moving KV blocks between actors: one interface, NCCL on GPUs, gloo on CPUs, a fake for tests.

`base` holds the contract (spec, states, errors, the BlockStore protocol, KVSender/KVReceiver) and
`config` its settings (KVTransferConfig, no torch); `sender`/`receiver` implement it over any
`link.Connector`, one thread (`send_worker`) or loop (`recv_loop`) per peer, each with two data
paths picked per link: the direct copy out of a mapped peer cache (`direct_send`, `direct_recv`)
and the streamed path through the link (`streamed_send`, `streamed_recv`); `frames` are the control
frames. `fake` and `torch_dist` (with `dist_link`) are the two connectors. Nothing is imported
here (import each name from its module), so importing `tandem.kv_transfer.config` loads no torch.
"""
