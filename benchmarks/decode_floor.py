"""The matmul floor of one decode step of SmolLM2-135M-Instruct on this CPU (docs/benchmarks.md,
the real-model section): ``rows`` vectors through every weight matrix of the model in its real
shapes (30 layers of q, k, v, o, gate, up, down, and the 49,152 x 576 head), with torch's
``F.linear`` as the HF engine runs them, and the time to read all the weights once.

    python benchmarks/decode_floor.py --threads 2

A sampler that runs these matmuls one decode step at a time cannot be faster than this per
generated token.
"""

import argparse
import time

import torch
import torch.nn.functional as F

HIDDEN, INTERMEDIATE, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152  # SmolLM2-135M


def best_of(fn, repeats: int = 6) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layer = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
             (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    weights = [torch.randn(out, inp) * 0.02 for out, inp in layer * LAYERS + [(VOCAB, HIDDEN)]]
    params = sum(w.numel() for w in weights)
    for rows in args.rows:
        inputs = {size: torch.randn(rows, size) for size in (HIDDEN, INTERMEDIATE)}
        seconds = best_of(lambda: [F.linear(inputs[w.shape[1]], w) for w in weights])
        print(f"{rows} rows x {params / 1e6:.1f}M weights: {seconds * 1e3:.1f} ms per decode step, "
              f"{2 * rows * params / seconds / 1e9:.1f} GFLOP/s")
    flat = torch.randn(params)
    seconds = best_of(flat.sum)
    print(f"reading {params * 4 / 2**20:.0f} MiB once: {seconds * 1e3:.1f} ms ({params * 4 / seconds / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
