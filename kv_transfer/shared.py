"""What the two parts of one worker share when it prefills for others and decodes over one engine
(tandem.workers): the engine's one serving loop, and one sender and one receiver on the actor's
one connector. A link carries one direction between two actors, so an actor has one sender and one
receiver: the prefill part sends prompts' KV and receives prefix pulls on them, the decode part
receives prompts' KV and sends prefix pulls. Their transfer ids never collide (the router names a
transfer `<request>#<tag>`, its pull `<transfer>/pull`, a decode request `<request>/<attempt>`).
The owner reaps each end once per step and hands what ended to both parts; each ignores the ids
it does not hold."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.serving_loop import EngineLoop
from tandem.kv_transfer.receiver import LayerStreamReceiver
from tandem.kv_transfer.sender import LayerStreamSender


@dataclass(frozen=True)
class SharedEngine:
    loop: EngineLoop                   # started by the owner once both parts exist
    sender: LayerStreamSender
    receiver: LayerStreamReceiver
