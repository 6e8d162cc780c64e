"""Where exporter.start()'s helper spends its CPU: each part's thread CPU per call, measured in
place inside the helper while it serves one process at 1 Hz and answers one kept-alive scrape
a second (bench.helper_cpu's set-up), so with the caches as a once-a-second call finds them.

    python -m bench.helper_breakdown --seconds 30

A `sitecustomize` put first on the helper's PYTHONPATH wraps the parts named in PARTS (and,
at the first paced tick, each source's read and each sample listener) with
time.thread_time(), and writes the sums when the bench sends SIGUSR1. The parts nest (a body
holds its render): a table of where the time goes, not a sum. One JSON object on the last
line: per part, its calls per second, mean microseconds per call and ms per second.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.helper_cpu import REPO, _threads, served

# (module, class or "", function): what is timed inside the helper.
PARTS = (
    ("exporter.exposition", "ExpositionCache", "body"),
    ("exporter.exposition", "ExpositionCache", "_render"),
    ("exporter.metrics", "SampleCollector", "families"),
    ("exporter.exposition_templates", "TemplateRenderer", "render"),
    ("exporter.own_process_metrics", "OwnProcessMetrics", "families"),
    ("exporter.exposition", "", "gzip_compress"),
    ("exporter.sampler", "Sampler", "tick"),
    ("exporter.transport.aggregator", "Aggregator", "_read"),
    ("exporter.transport.peer", "Peer", "take_record"),
    ("exporter.transport.aggregator", "Aggregator", "read"),
    ("exporter.http.guard", "GuardedConnection", "data_received"),
    ("exporter.http.guard", "GuardedConnection", "answer_done"),
)

_SITECUSTOMIZE = """
import importlib, json, os, signal, sys, threading, time
if "exporter.helper" in " ".join(getattr(sys, "orig_argv", sys.argv)):
    _acc = {}
    def _timed(fn, key):
        def timed(*args, **kwargs):
            started = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                entry = _acc.setdefault(key, [0, 0.0])
                entry[0] += 1
                entry[1] += time.thread_time() - started
        return timed
    def _install():
        for module, cls, name in PARTS:
            owner = importlib.import_module(module)
            owner = getattr(owner, cls) if cls else owner
            setattr(owner, name, _timed(getattr(owner, name), f"{cls}.{name}" if cls else name))
        from exporter import sampler
        paced = sampler.Sampler.paced_tick
        def paced_tick(self, heard):
            if not getattr(self, "_timed_parts", False):
                self._timed_parts = True
                for source in self.sources:
                    source.read = _timed(source.read, "read:" + type(source).__name__)
                self.listeners = [
                    _timed(l, "listener:" + getattr(l, "__name__", type(l).__name__))
                    for l in self.listeners
                ]
            return paced(self, heard)
        sampler.Sampler.paced_tick = _timed(paced_tick, "Sampler.paced_tick")
    def _dump(*_):
        with open(os.environ["GPUMEM_BREAKDOWN_OUT"], "w") as out:
            json.dump(_acc, out)
    signal.signal(signal.SIGUSR1, _dump)
    def _later():
        time.sleep(2.0)  # after the helper has imported what it serves with
        try:
            _install()
        except Exception as exc:
            print("breakdown: cannot wrap:", exc, file=sys.stderr)
    threading.Thread(target=_later, daemon=True).start()
"""


def measure(root: str, seconds: float, torch_kind: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="helper-breakdown-") as folder:
        (Path(folder) / "sitecustomize.py").write_text(f"PARTS = {PARTS!r}\n" + _SITECUSTOMIZE)
        out = Path(folder) / "parts.json"
        env = {"GPUMEM_BREAKDOWN_OUT": str(out)}
        with served(root, torch_kind, first=folder, env=env) as (helper, scrape):
            for _ in range(4):  # past the first samples and the wrapping (2 s in)
                scrape()
                time.sleep(1.0)
            helper.send_signal(signal.SIGUSR1)
            time.sleep(0.2)
            before = json.loads(out.read_text())
            threads_before = _threads(helper.pid)
            started = time.monotonic()
            while time.monotonic() - started < seconds:
                scrape()
                time.sleep(1.0)
            threads_after = _threads(helper.pid)
            helper.send_signal(signal.SIGUSR1)
            time.sleep(0.2)
            after = json.loads(out.read_text())
            wall = time.monotonic() - started
    parts = {}
    for key, (calls, cpu_s) in sorted(after.items()):
        calls -= before.get(key, (0, 0.0))[0]
        cpu_s -= before.get(key, (0, 0.0))[1]
        if calls:
            parts[key] = {
                "calls_per_s": round(calls / wall, 2),
                "us_per_call": round(cpu_s / calls * 1e6, 1),
                "ms_per_s": round(cpu_s / wall * 1e3, 3),
            }
    threads = {
        name: round((ns - threads_before.get(name, (0, 0))[0]) / wall / 1e6, 3)
        for name, (ns, _) in threads_after.items()
    }
    return {"root": root, "threads_ms_per_s": threads, "parts": parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(REPO), help="the checkout to measure")
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    try:
        import torch

        kind = "real" if torch.cuda.is_available() else "fake"
    except ImportError:
        kind = "fake"
    result = {"torch": kind, **measure(str(Path(args.root).resolve()), args.seconds, kind)}
    for key, part in result["parts"].items():
        line = f"{key:45s} {part['calls_per_s']:6.2f}/s {part['us_per_call']:8.1f} us"
        print(line, file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
