"""A real multi-process inference server for GPU tests: LitServe with 2 workers on one GPU,
each holding 1 GiB of model weights on it. LitServe has no SIGTERM handler of its own: a
SIGTERM to its main process alone orphans its workers (docs/facts.md).

    python tests/support/litserve_app.py PORT
"""

import sys

import litserve as ls
import torch


class Api(ls.LitAPI):
    def setup(self, device: str) -> None:
        self.weights = torch.ones(1 << 28, dtype=torch.float32, device=device)  # 1 GiB

    def decode_request(self, request: dict) -> float:
        return float(request["x"])

    def predict(self, x: float) -> float:
        return float(self.weights[0].item() * x)

    def encode_response(self, output: float) -> dict:
        return {"y": output}


if __name__ == "__main__":
    server = ls.LitServer(Api(), accelerator="cuda", devices=1, workers_per_device=2)
    server.run(host="127.0.0.1", port=int(sys.argv[1]), generate_client_file=False)
