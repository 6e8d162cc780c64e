"""What a sleeping thread's wake-up costs its process: CPU per wake of the ways a sampler
thread can wait for its next tick, beside an asyncio loop waking every 1 ms (as in
bench.loop_lateness), each way in its own thread, all at the same interval.

    python -m bench.wakeups --interval-s 1.0 --seconds 60

Ways: `Event.wait(interval)` (threading's Condition: a lock made and queued in Python at each
wait), a held `Lock.acquire(timeout=interval)` (one C call), `select.poll` on a pipe, and
`time.sleep`. CPU is each thread's own clock (user and system), per wake. One JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any


def measure(interval_s: float, seconds: float) -> dict[str, Any]:
    stop = threading.Event()
    held = threading.Lock()
    held.acquire()
    readable, writable = os.pipe()
    wakes: dict[str, int] = {}

    def event() -> None:
        while not stop.wait(interval_s):
            wakes["event"] = wakes.get("event", 0) + 1

    def lock() -> None:
        while not held.acquire(True, interval_s):
            wakes["lock"] = wakes.get("lock", 0) + 1

    def poll() -> None:
        poller = select.poll()
        poller.register(readable, select.POLLIN)
        while not poller.poll(interval_s * 1000):
            wakes["poll"] = wakes.get("poll", 0) + 1

    def sleep() -> None:
        while not stop.is_set():
            time.sleep(interval_s)
            wakes["sleep"] = wakes.get("sleep", 0) + 1

    ways: dict[str, Callable[[], None]] = {
        "event": event,
        "lock": lock,
        "poll": poll,
        "sleep": sleep,
    }
    threads = {name: threading.Thread(target=way, name=name) for name, way in ways.items()}
    for thread in threads.values():
        thread.start()

    def cpu() -> dict[str, float]:
        return {
            name: time.clock_gettime(time.pthread_getcpuclockid(thread.ident or 0))
            for name, thread in threads.items()
        }

    time.sleep(interval_s * 1.5)  # each has slept and woken once
    before, counted = cpu(), dict(wakes)

    async def loop() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            await asyncio.sleep(0.001)

    asyncio.run(loop())
    after, done = cpu(), dict(wakes)
    stop.set()
    held.release()
    os.write(writable, b"x")
    for thread in threads.values():
        thread.join()
    result = {}
    for name in ways:
        n = done.get(name, 0) - counted.get(name, 0)
        result[name] = {
            "wakes": n,
            "cpu_us_per_wake": (after[name] - before[name]) / max(n, 1) * 1e6,
        }
    return {"interval_s": interval_s, "seconds": seconds, "ways": result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    rounds = [measure(args.interval_s, args.seconds) for _ in range(args.rounds)]
    print(json.dumps({"rounds": rounds}))


if __name__ == "__main__":
    main()
