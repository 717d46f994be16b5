"""`make run`: start `tandem up` (local Ray on CPU, smollm2-135m, 1 prefill + 1 decode actor), send a
scripted three-turn coding session through the gRPC API, print tokens as they stream and each
turn's usage (cached prompt tokens grow turn by turn), then shut the cluster down.

`--offline` runs the same session in this process through the engine alone.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.cluster.commands import stream_generate
from tandem.engine.config import EngineConfig
from tandem.protos.tandem.v1 import generation_pb2_grpc
from tandem.wire.messages import SamplingParams

TURNS = [
    "Write a Python function `is_prime(n)` that returns True when n is prime.",
    "Now add a docstring and type hints to it.",
    "Write a pytest test for it with three cases.",
]
BOLD, DIM, RESET = ("\033[1m", "\033[2m", "\033[0m") if sys.stdout.isatty() else ("", "", "")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(target: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"tandem up exited with {proc.returncode}")
        try:
            r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            if r.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{target} not serving after {timeout_s:.0f} s")


def run_session(target: str, max_tokens: int) -> None:
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(target))
    messages: list[dict[str, str]] = []
    for turn, user in enumerate(TURNS, 1):
        messages.append({"role": "user", "content": user})
        print(f"\n{BOLD}[turn {turn}] user:{RESET} {user}\n{BOLD}assistant:{RESET} ", end="", flush=True)
        t0 = time.perf_counter()
        first = []

        def show(text):
            first.append(first[0] if first else time.perf_counter())
            sys.stdout.write(text)
            sys.stdout.flush()

        reply, _, last = stream_generate(stub, messages=messages, session_id="demo-session", max_tokens=max_tokens,
                                         on_text=show, timeout=300)
        dt = time.perf_counter() - t0
        u = last.usage
        ttft = (first[0] - t0) * 1000 if first else float("nan")
        print(f"\n{DIM}(prompt {u.prompt_tokens} tokens, {u.cached_prompt_tokens} cached; {u.completion_tokens} "
              f"generated; TTFT {ttft:.0f} ms; {u.completion_tokens / dt:.1f} tok/s){RESET}")
        messages.append({"role": "assistant", "content": reply})


def run_cluster(model: str, max_tokens: int) -> int:
    port = _free_port()
    target = f"127.0.0.1:{port}"
    # prompts with more than 32 uncached tokens go to the prefill actor (turn 1); later turns, whose
    # new part is short, are prefilled by the decode actor from its prefix cache
    args = ["up", "--model", model, "--prefill", "1", "--decode", "1", "--port", str(port),
            "--local-prefill-threshold", "32"]
    cmd = [sys.executable, "-m", "tandem.cluster.cli", *args]
    print(f"{DIM}$ tandem {' '.join(args)}{RESET}", flush=True)
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_serving(target, 600, proc)
        run_session(target, max_tokens)
        # status reports the stats the controller's health polls (every second) brought back, each
        # asked for a poll before it is read: let two pass, so it shows the pools after the session
        # rather than during its last turn
        time.sleep(2.5)
        print(f"\n{DIM}$ tandem status --target {target}{RESET}", flush=True)
        subprocess.run([sys.executable, "-m", "tandem.cluster.cli", "status", "--target", target], check=False)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0


def run_offline(model: str, max_tokens: int) -> int:
    from tandem.engine.engine import LLMEngine  # noqa: PLC0415 - torch loads only for --offline

    engine = LLMEngine(EngineConfig(model=model))
    messages: list[dict[str, str]] = []
    for turn, user in enumerate(TURNS, 1):
        messages.append({"role": "user", "content": user})
        print(f"\n{BOLD}[turn {turn}] user:{RESET} {user}\n{BOLD}assistant:{RESET} ", end="", flush=True)
        engine.add_request(f"turn-{turn}", messages=messages, sampling=SamplingParams(max_tokens=max_tokens))
        reply = ""
        while engine.has_unfinished():
            for out in engine.step():
                reply += out.new_text
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
                if out.finished:
                    u = out.usage
        print(f"\n{DIM}(prompt {u.prompt_tokens} tokens, {u.cached_prompt_tokens} cached; "
              f"{u.completion_tokens} generated){RESET}")
        messages.append({"role": "assistant", "content": reply})
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--offline", action="store_true")
    a = p.parse_args()
    return (run_offline if a.offline else run_cluster)(a.model, a.max_tokens)


if __name__ == "__main__":
    sys.exit(main())
