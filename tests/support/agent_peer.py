"""A stand-in agent for aggregator tests: a real process that speaks the agent protocol.

    python -m tests.support.agent_peer SOCKET MODE RANK_CLAIM

MODE: "answer" replies to each command it gets (after 0.3 s) with {"who": "answer"};
"spoof" keeps sending replies for request ids 1..20, each {"who": "spoof"}, as if it had
been asked, every 50 ms for 10 s. Both say hello claiming rank RANK_CLAIM, send one sample
with one allocator, print "ready", and stay until stdin closes.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time


def send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def main() -> None:
    path, mode, rank = sys.argv[1], sys.argv[2], sys.argv[3]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    process = {"pid": "1", "rank": rank, "local_rank": "", "role": mode}
    send(sock, {"type": "hello", "version": 1, "process": process})
    allocator = {
        "device": 0,
        "gpu_uuid": "GPU-peer",
        "backend": "native",
        "expandable_segments": False,
        "gauges": {"allocated_bytes": 1},
    }
    send(sock, {"type": "sample", "allocators": [allocator]})

    def spoof() -> None:
        for _ in range(200):
            for request_id in range(1, 21):
                result = {"ok": True, "result": {"who": "spoof"}}
                send(sock, {"type": "reply", "id": request_id, "result": result})
            time.sleep(0.05)

    if mode == "spoof":
        threading.Thread(target=spoof, daemon=True).start()

    def answer() -> None:
        buffer = b""
        while chunk := sock.recv(65536):
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                command = json.loads(line)
                if mode == "answer":
                    time.sleep(0.3)
                    result = {"ok": True, "result": {"who": "answer"}}
                    send(sock, {"type": "reply", "id": command["id"], "result": result})

    threading.Thread(target=answer, daemon=True).start()
    print("ready", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
