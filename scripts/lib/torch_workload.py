"""The PyTorch workloads of scripts/bench_fikit_torch (they need torch, torchvision and a CUDA
GPU; nothing of gpuloom: they run under the shim as any user program does).

    python3 scripts/lib/torch_workload.py infer --requests N [--rate R] [--model M] [--seed S]
                                                [--ready-file F] [--stop-file F]
    python3 scripts/lib/torch_workload.py train [--iterations N | --stop-file F] [--batch B]
                                                [--ready-file F] [--max-seconds S]

`infer`: an inference service's requests, one at a time (batch 1, 224x224 images, the model in
eval mode with random weights: no download). Between requests the host thinks for an
exponentially distributed time of mean 1/R s, as a service whose clients arrive at rate R with
an empty queue. A request's latency is from its start to the end of its last kernel
(`torch.cuda.synchronize`). Warm-up requests (module loading, allocator growth) are not counted.
After them it writes `--ready-file` (if given); it stops after N requests or once `--stop-file`
exists (a neighbour's load: N large, rate 0 for back to back).

`train`: a training loop on synthetic data (ResNet-50 by default, SGD), back to back, for
`--iterations` or until `--stop-file` exists. After its warm-up iterations it writes
`--ready-file` (if given): iterations are counted from there.

Each prints one JSON object on stdout when it ends.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from typing import Any

WARMUP = 20


def _model(name: str) -> Any:  # torch is imported late, for a fast --help
    import torchvision

    builders = {
        "resnet50": torchvision.models.resnet50,
        "mobilenet_v2": torchvision.models.mobilenet_v2,
        "resnet18": torchvision.models.resnet18,
    }
    if name not in builders:
        raise SystemExit(f"--model {name!r}: not one of {', '.join(sorted(builders))}")
    return builders[name](weights=None)


def say_ready(path: str) -> None:
    """Past the warm-up: the bench starts its other workload now (if it gave a file)."""
    if path:
        with open(path, "w") as ready:
            ready.write(str(os.getpid()))


def infer(args: argparse.Namespace) -> dict[str, object]:
    import torch

    model = _model(args.model).cuda().eval()
    image = torch.randn(1, 3, 224, 224, device="cuda")
    think = random.Random(args.seed)
    latencies_ms: list[float] = []
    began = 0.0
    with torch.inference_mode():
        for n in range(WARMUP + args.requests):
            if n == WARMUP:
                began = time.perf_counter()
                say_ready(args.ready_file)
            if args.stop_file and n >= WARMUP and os.path.exists(args.stop_file):
                break
            start = time.perf_counter()
            model(image)
            torch.cuda.synchronize()
            if n >= WARMUP:
                latencies_ms.append((time.perf_counter() - start) * 1e3)
            if args.rate > 0:
                time.sleep(think.expovariate(args.rate))
    seconds = time.perf_counter() - began
    ordered = sorted(latencies_ms) or [math.nan]
    return {
        "mode": "infer",
        "model": args.model,
        "requests": len(latencies_ms),
        "requests_per_s": len(latencies_ms) / seconds if seconds > 0 else 0.0,
        "mean_ms": sum(ordered) / len(ordered),
        "p50_ms": ordered[len(ordered) // 2],
        "p99_ms": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))],
        "latencies_ms": [round(x, 4) for x in latencies_ms],
    }


def train(args: argparse.Namespace) -> dict[str, object]:
    import torch

    model = _model(args.model).cuda().train()
    optimiser = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(args.batch, 3, 224, 224, device="cuda")
    labels = torch.randint(0, 1000, (args.batch,), device="cuda")
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        optimiser.zero_grad(set_to_none=True)
        loss_fn(model(images), labels).backward()
        optimiser.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    say_ready(args.ready_file)
    began = time.perf_counter()
    deadline = began + args.max_seconds
    iterations = 0
    while time.perf_counter() < deadline:
        if args.iterations and iterations >= args.iterations:
            break
        if args.stop_file and os.path.exists(args.stop_file):
            break
        step()
        iterations += 1
        if iterations % 4 == 0:
            torch.cuda.synchronize()  # a real loop reads its loss now and then
    torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    return {
        "mode": "train",
        "model": args.model,
        "batch": args.batch,
        "iterations": iterations,
        "seconds": seconds,
        "iterations_per_s": iterations / seconds if seconds > 0 else 0.0,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    inference = modes.add_parser("infer")
    inference.add_argument("--requests", type=int, required=True)
    inference.add_argument("--rate", type=float, default=50.0, help="requests/s (0: none)")
    inference.add_argument("--model", default="resnet50")
    inference.add_argument("--seed", type=int, default=0)
    inference.add_argument("--ready-file", default="")
    inference.add_argument("--stop-file", default="")
    training = modes.add_parser("train")
    training.add_argument("--iterations", type=int, default=0)
    training.add_argument("--stop-file", default="")
    training.add_argument("--ready-file", default="")
    training.add_argument("--batch", type=int, default=32)
    training.add_argument("--model", default="resnet50")
    training.add_argument("--max-seconds", type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.mode == "infer" and (args.requests < 1 or args.rate < 0):
        parser.error("--requests must be at least 1 and --rate at least 0")
    if args.mode == "train" and (args.batch < 1 or args.iterations < 0 or args.max_seconds <= 0):
        parser.error("--batch must be at least 1, --iterations at least 0, --max-seconds above 0")
    if args.mode == "train" and not (args.iterations > 0 or args.stop_file):
        parser.error("train needs --iterations N (N > 0) or --stop-file")
    result = infer(args) if args.mode == "infer" else train(args)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
