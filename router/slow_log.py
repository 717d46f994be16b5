"""Where a slow first token's time went, as the router saw it: placing it (the decode actor's
reserve, then the prefill actor's reserve, prefix pull and start), the prefill and transfer (with the
prefill actor's own split when it reported one; the first token comes with its result), and from
there to the token's send; or the local prefill and first step. Reads an attempt's marks only."""

from __future__ import annotations

from tandem.router.placing import Attempt


def _ms(a: float, b: float) -> str:
    return f"{1e3 * (b - a):.0f} ms"


def _split(timings: dict[str, float]) -> str:
    return ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in timings.items())


def slow_first_token_parts(att: Attempt, t0: float, now: float, migrations: int) -> list[str]:
    m = att.marks
    parts = [f"{att.mode} on {att.decode_id}"]
    if "decode_reserved" in m:
        parts.append(f"decode reserve {_ms(t0, m['decode_reserved'])}")
    task = att.prefill_task
    if "prefill_started" in m and task is None:   # the remote prefill failed: local instead
        parts.append(f"remote prefill failed after {_ms(m['prefill_started'], m.get('kv_sent', now))}, "
                     f"then local prefill + first step {_ms(m.get('kv_sent', now), now)}")
    elif "prefill_started" in m:
        parts.append(f"prefill placed on {att.prefill_id} {_ms(m['decode_reserved'], m['prefill_started'])}")
        if "kv_sent" not in m:    # the common case: the token went out ahead of the last layers
            split = _split(m.get("first_timings", {}))
            parts.append(f"prefill to first token {_ms(m['prefill_started'], now)}"
                         + (f" ({split})" if split else "") + ", KV still on the wire")
        else:
            ok = task.done() and not task.cancelled() and task.exception() is None
            split = _split(task.result().timings if ok else {})
            parts.append(f"prefill+transfer {_ms(m['prefill_started'], m['kv_sent'])}"
                         + (f" ({split})" if split else ""))
            parts.append(f"KV sent to first token {_ms(m['kv_sent'], now)}")
    elif "decode_reserved" in m:
        parts.append(f"local prefill + first step {_ms(m['decode_reserved'], now)}")
    if migrations:
        parts.append(f"after {migrations} migration(s)")
    return parts
