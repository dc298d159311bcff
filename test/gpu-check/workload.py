#!/usr/bin/env python3
"""GPU workload for test/gpu-check/run.sh (needs PyTorch with CUDA).

  workload.py hold --gib N --dir DIR   hold N GiB of device memory with known content; on SIGUSR1
                                       verify it and write DIR/verify.<n> ("ok <sec>" or "bad ...");
                                       DIR/ready once filled; SIGTERM exits. No fd stays open on
                                       DIR or a terminal, so CRIU can dump and restore the process.
  workload.py bw --gib N               print host<->device copy bandwidth (pinned memory), JSON.
"""
import argparse
import json
import os
import signal
import sys
import time

import torch

CHUNK = 1 << 28  # int64 elements per chunk: 2 GiB


def pattern(start, n, dev):
    # Known content: a multiplicative hash of the element index, so a shifted, zeroed or stale
    # page never matches.
    i = torch.arange(start, start + n, dtype=torch.int64, device=dev)
    return (i * 2654435761 + 12345) % 2147483647


def write(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text + "\n")
    os.rename(path + ".tmp", path)


def hold(args):
    dev = torch.device("cuda:0")
    n = args.gib * (1 << 30) // 8
    t0 = time.time()
    chunks = []
    for start in range(0, n, CHUNK):
        chunks.append(pattern(start, min(CHUNK, n - start), dev))
    torch.cuda.synchronize()
    state = {"pending": 0, "stop": False, "count": 0}

    def verify():
        t = time.time()
        ok = True
        for k, c in enumerate(chunks):
            if not torch.equal(c, pattern(k * CHUNK, c.numel(), dev)):
                ok = False
                break
        torch.cuda.synchronize()
        state["count"] += 1
        res = "ok" if ok else "bad chunk %d" % k
        write(os.path.join(args.dir, "verify.%d" % state["count"]), "%s %.3f" % (res, time.time() - t))

    signal.signal(signal.SIGUSR1, lambda *_: state.__setitem__("pending", state["pending"] + 1))
    signal.signal(signal.SIGTERM, lambda *_: state.__setitem__("stop", True))
    write(os.path.join(args.dir, "ready"), json.dumps({
        "pid": os.getpid(), "bytes": n * 8, "fill_seconds": round(time.time() - t0, 3),
        "allocated": torch.cuda.memory_allocated(dev), "reserved": torch.cuda.memory_reserved(dev)}))
    while not state["stop"]:
        if state["pending"]:
            state["pending"] -= 1
            verify()
        time.sleep(0.05)


def bw(args):
    dev = torch.device("cuda:0")
    n = args.gib * (1 << 30)
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(n, dtype=torch.uint8, device=dev)
    d.copy_(h, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    res = {"bytes": n}
    for name, dst, src in (("h2d", d, h), ("d2h", h, d)):
        best = None
        for _ in range(3):
            t = time.time()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            s = time.time() - t
            best = s if best is None else min(best, s)
        res[name + "_gbps"] = round(n / best / 1e9, 2)
    res["device"] = torch.cuda.get_device_name(dev)
    res["torch"] = torch.__version__
    res["torch_cuda"] = torch.version.cuda
    print(json.dumps(res))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["hold", "bw"])
    p.add_argument("--gib", type=int, default=4)
    p.add_argument("--dir", default=".")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("workload.py: torch sees no CUDA device", file=sys.stderr)
        sys.exit(3)
    hold(args) if args.mode == "hold" else bw(args)


if __name__ == "__main__":
    main()
