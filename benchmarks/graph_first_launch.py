"""A freshly captured CUDA graph's first launch against its second: the first also uploads the
graph to the device. `capture_graph` (flashtree/graphs/runner.py) replays every graph once at
capture for this reason.

    python benchmarks/graph_first_launch.py   # needs CUDA; prints ms per launch, 3 trials

Each trial captures 8 graphs of 150 layers of 4 small kernels ([64, 576] activations, about a
small model's decode step) and times each graph's first launch, then its second."""

from __future__ import annotations

import time

import torch


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("graph_first_launch needs a CUDA device")
    device = torch.device("cuda")
    x = torch.randn(64, 576, device=device)
    w = torch.randn(576, 576, device=device)

    def layers() -> torch.Tensor:
        y = x
        for _ in range(150):
            y = torch.tanh(y @ w) * 0.5 + y
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # library handles and kernels loaded before capture
        layers()
    torch.cuda.current_stream().wait_stream(side)

    def launch_ms(graph: torch.cuda.CUDAGraph) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    for trial in range(3):
        graphs = []
        for _ in range(8):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                layers()
            graphs.append(graph)
        first = [launch_ms(g) for g in graphs]
        second = [launch_ms(g) for g in graphs]
        print(f"trial {trial}: first launch ms {' '.join(f'{v:.2f}' for v in first)} | "
              f"second {' '.join(f'{v:.2f}' for v in second)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
