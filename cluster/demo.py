"""`make run`: a scripted three-turn coding session, streamed token by token.

Runs offline through the engine (one process); each turn's prompt is the whole conversation so
far, so the prefix cache serves the earlier turns and only the new tokens are computed.
"""

from __future__ import annotations

import sys
import time

TURNS = [
    "Write a Python function `is_prime(n)` that returns True when n is prime.",
    "Now add a docstring and type hints to it.",
    "Write a pytest test for it with three cases.",
]


def run_offline(model: str = "smollm2-135m", max_tokens: int = 120) -> None:
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.request import SamplingParams

    print(f"loading {model} ...", flush=True)
    engine = LLMEngine(EngineConfig(model=model))
    messages: list[dict[str, str]] = []
    for turn, user in enumerate(TURNS, 1):
        messages.append({"role": "user", "content": user})
        print(f"\n\033[1m[turn {turn}] user:\033[0m {user}\n\033[1massistant:\033[0m ", end="", flush=True)
        engine.add_request(f"turn-{turn}", messages=messages, sampling=SamplingParams(max_tokens=max_tokens))
        reply, t0, first = "", time.perf_counter(), None
        while engine.has_unfinished():
            for out in engine.step():
                first = first or time.perf_counter()
                reply += out.new_text
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
                if out.finished:
                    u = out.usage
        dt = time.perf_counter() - t0
        print(f"\n\033[2m(prompt {u.prompt_tokens} tokens, {u.cached_prompt_tokens} cached; "
              f"{u.completion_tokens} generated; TTFT {1000 * (first - t0):.0f} ms; "
              f"{u.completion_tokens / dt:.1f} tok/s)\033[0m")
        messages.append({"role": "assistant", "content": reply})


if __name__ == "__main__":
    run_offline()
