"""vLLM server start on CPU: the engine core forked from the API server (prl's default) against spawned, in one run.

    python bench/bench_server_start.py [--runs 3]

Starts `python -m prl.inference` on the test suite's tiny Qwen3 (`prl/trainer/tiny_model.py`; vLLM, float32,
`--enforce-eager`, as the suite and the shipped CPU topologies start it) `--runs` times with each start method,
alternating which goes first, and prints for each the seconds from the command to a healthy `/health`, and the CPU
seconds the API server and its engine core had used by then. `spawn` is vLLM's own choice
(`VLLM_WORKER_MULTIPROC_METHOD=spawn`, which prl honours); `fork` is what `prl.inference` does on a CPU host
(`cpu_engine_setup` and `engine_client` in prl/inference/server.py). Medians, and fork / spawn.

Every start must serve: one greedy completion, the same text from both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from prl.trainer.tiny_model import build_tiny_model  # noqa: E402
from testkit.servers import http_json, start_inference  # noqa: E402

METHODS = ("spawn", "fork")


def one_start(root: Path, model: Path, method: str) -> tuple[float, float, str]:
    """Seconds to healthy, CPU seconds of the server's processes by then, and a greedy completion."""
    with start_inference(root, model, env={"VLLM_WORKER_MULTIPROC_METHOD": method},
                         log_path=root / f"server-{method}.log") as server:
        up = server.start_seconds
        api = psutil.Process(server.process.pid)
        cpu = sum(sum(p.cpu_times()[:2]) for p in [api, *api.children(recursive=True)])
        out = http_json("POST", server.url + "/v1/completions",
                        {"model": str(model), "prompt": "The capital of France is", "max_tokens": 8,
                         "temperature": 0})
    return up, cpu, out["choices"][0]["text"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    runs = parser.parse_args().runs
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in METHODS}
    texts = set()
    with tempfile.TemporaryDirectory(prefix="prl-bench-start-") as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model")
        for run in range(runs):
            for method in METHODS if run % 2 == 0 else METHODS[::-1]:
                up, cpu, text = one_start(root, model, method)
                times[method].append((up, cpu))
                texts.add(text)
                print(f"run {run + 1} {method:5s}: healthy after {up:5.1f} s, {cpu:5.1f} CPU s", flush=True)
    if len(texts) != 1:
        raise SystemExit(f"the two start methods served different completions: {texts}")
    median = {m: [statistics.median(x[i] for x in times[m]) for i in (0, 1)] for m in METHODS}
    for m in METHODS:
        print(f"{m:5s} median: healthy after {median[m][0]:5.1f} s, {median[m][1]:5.1f} CPU s")
    print(f"fork / spawn: {median['fork'][0] / median['spawn'][0]:.2f}x to healthy, "
          f"{median['fork'][1] / median['spawn'][1]:.2f}x CPU")


if __name__ == "__main__":
    main()
