"""The worker's own path on a card: one real ``renderfleet worker`` against the bench's pipeline figure.

The benchmark (``bench/gpu_bench.py``) times the pipeline call alone, the
images left as tensors on the card.  A worker does more for each image: it
takes a shard off the queue, claims and heartbeats its lease, renders through
the same :class:`~worker.render.pipeline.Renderer` but for PIL output (the NaN
check and 8 bits on the card, a copy to the host), encodes a PNG per image in
its upload pool, writes each to the store and commits a checkpoint.  Issue 48's
goal: the worker's images per second within 5 % of the pipeline's on the card.

So both are measured here, in the same run, on the same weights loaded the
same way, taking turns:

1. SD 1.5's shape (random weights, ``bench/gpu_archs.py``) built on the card and
   saved with ``save_pretrained`` to a folder: the model a worker loads by path;
2. a private Redis (``testing.fleet.start_redis``), a folder store, and one
   ``renderfleet worker`` process (Celery, leases, the commit queue) serving that
   folder, its render batch pinned to the bench's (``RENDERFLEET_RENDER_BATCH``);
3. in this process the same folder loaded as the worker loads it
   (``load_pipeline``), and the bench's pipeline figure measured as the bench
   measures it (``Renderer.generate(output_type="pt")``, synchronised);
4. a warm-up on each side (untimed: the worker's first shard, this process's
   first call), then ``--runs`` turns: :data:`PROMPTS` prompts in calls of
   :data:`BATCH` here, then the same prompts as one job through the worker
   (from the submit call to its last prompt counted done, every 20 ms).

Both eager, in bf16 at 512x512, 25 steps, guidance 7.5, batch 16: the
worker's figure is its steady rate (its model load and first shard are out of
it); the ratio is the figure that counts.  Its time on an H200, estimated
(not yet run on a card): the model built and saved in about 10 s, the worker
started and loaded in 20-30 s beside this process's load, then about 5 img/s
on each side (SD 1.5 eager at batch 16 was 5.23 in the last card run): 64
prompts about 13 s a side a turn, 2 turns: 90-110 s in all.

``--tiny``: the same path at toy sizes on any device (a dry run: its figures mean nothing).

    python -m bench.gpu_worker --out worker.json             # on the card (make gpu-check runs it)
    python -m bench.gpu_worker --tiny --out worker.json      # anywhere
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.gpu_archs import SD15, Arch, build, tiny

BATCH = 16
PROMPTS = 64
RUNS = 2
TINY_BATCH, TINY_PROMPTS = 2, 8
POOL = "gpu-check"
# The product's lease settings (renderfleet.settings), not the tests' short ones (testing.fleet.FAST_LEASES).
PRODUCT_LEASES = {"RENDERFLEET_LEASE_SECONDS": "6", "RENDERFLEET_HEARTBEAT_SECONDS": "1.5", "RENDERFLEET_REAP_SECONDS": "1"}
JOB_TIMEOUT_SECONDS = 600.0


def case(tiny_sizes: bool) -> tuple[Arch, int, int]:
    """(the architecture, the batch, the prompts a turn): SD 1.5 at 512x512, 25 steps, 16 a call, 64 a turn;
    toy sizes with ``tiny_sizes``."""
    if tiny_sizes:
        return replace(tiny(SD15), name="sd15-worker-tiny"), TINY_BATCH, TINY_PROMPTS
    return replace(SD15, name="sd15-worker"), BATCH, PROMPTS


def save_model(arch: Arch, device: str, folder: Path) -> float:
    """``arch`` built on ``device`` with random weights and saved to ``folder`` (safetensors): its seconds."""
    import torch

    from worker.render.models.loading import save_pipeline

    started = time.perf_counter()
    loaded = build(arch, device)
    save_pipeline(loaded, folder)
    del loaded
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return time.perf_counter() - started


class Worker:
    """A private Redis, a folder store and one ``renderfleet worker`` serving ``model``; jobs submitted and counted."""

    def __init__(self, root: Path, model: str, device: str, batch: int) -> None:
        from renderfleet.api import Client
        from testing.fleet import WorkerProc, base_env, start_redis

        self.server = start_redis(root / "redis")
        env = base_env(root, self.server.url, str(root / "store"), **PRODUCT_LEASES)
        env.update(RENDERFLEET_RENDER_BATCH=str(batch), RENDERFLEET_DEVICE=device)
        if device.startswith("cuda"):
            env.pop("OMP_NUM_THREADS", None)  # a card's worker as deployed: torch's own thread count
        self.client = Client(redis_url=self.server.url, store=str(root / "store"))
        self.proc = WorkerProc(env, root / "worker.log", "--pool", POOL, "--model", model)
        self.model = model

    def ready(self, timeout: float = 300) -> None:
        from testing.fleet import wait_for, worker_ready

        def up() -> bool:
            if not self.proc.alive():
                raise RuntimeError(f"the worker exited at start:\n{self.proc.output()[-2000:]}")
            return worker_ready(self.client.redis, 1)

        wait_for(up, timeout, what="the worker to register (its model loaded)")

    def job(self, path: Path, arch: Arch, *, batch: int, seed: int, deadline: float) -> float:
        """Submit ``path`` and wait for it: wall seconds from the submit call to the last prompt counted done;
        :class:`RuntimeError` past ``deadline`` (``time.monotonic``), so the worker is still stopped in time."""
        from renderfleet import keys

        started = time.perf_counter()
        job = self.client.submit(
            path,
            model=self.model,
            steps=arch.steps,
            size=f"{arch.width}x{arch.height}",
            guidance=arch.guidance,
            seed=seed,
            shard_size=batch * 2,
            batch_size=batch,
            pool=POOL,
        )
        done = keys.done_bits(job.id)
        deadline = min(deadline, time.monotonic() + JOB_TIMEOUT_SECONDS)
        while self.client.redis.bitcount(done) < job.total:  # one command a poll
            if time.monotonic() > deadline or not self.proc.alive():
                raise RuntimeError(f"job {job.id}: not done: {job.status()}\n{self.proc.output()[-2000:]}")
            time.sleep(0.02)
        return time.perf_counter() - started

    def stop(self) -> None:
        self.proc.terminate(30)
        self.server.stop()


def pipeline_rate(renderer: Any, arch: Arch, prompts: int, batch: int, seed: int, cuda: bool) -> float:
    """The bench's pipeline figure: ``prompts`` in calls of ``batch`` (``generate``, tensors left on the card)."""
    import torch

    from renderfleet.spec import Prompt, derive_seed

    started = time.perf_counter()
    for first in range(0, prompts, batch):
        calls = [
            Prompt(
                i,
                f"{i:06d}",
                f"prompt number {i}",
                "",
                derive_seed(seed, i),
                arch.steps,
                arch.guidance,
                arch.width,
                arch.height,
            )
            for i in range(first, min(prompts, first + batch))
        ]
        renderer.generate(calls, output_type="pt")
    if cuda:
        torch.cuda.synchronize()
    return prompts / (time.perf_counter() - started)


def run_worker_path(*, tiny_sizes: bool, device: str, runs: int, budget: float, log: Any) -> dict[str, Any]:
    """The case's figures: each turn's pipeline and worker images/s, their medians and the ratio.  A turn that would
    end past ``budget`` seconds is not started (at least one is): the worker, a process of its own that a kill
    of this one would leave on the card, is always stopped here."""
    import torch

    from testing.fleet import write_prompts
    from worker.render.models import load_pipeline
    from worker.render.pipeline import Renderer

    arch, batch, prompts = case(tiny_sizes)
    cuda = device.startswith("cuda")
    deadline = time.monotonic() + budget
    threads = torch.get_num_threads()
    info: dict[str, Any] = {"model": arch.name, "size": f"{arch.width}x{arch.height}", "steps": arch.steps}
    info.update(guidance=arch.guidance, batch=batch, prompts=prompts, runs=runs, mode="eager")
    with tempfile.TemporaryDirectory(prefix="renderfleet-gpu-worker-") as tmp:
        root = Path(tmp)
        # 1. The model, saved where the worker loads it by path.
        folder = root / "model"
        info["build_and_save_seconds"] = save_model(arch, device, folder)
        # 2. The worker (its start and load run beside this process's load).
        worker = Worker(root, str(folder), device, batch)
        try:
            if not cuda:
                torch.set_num_threads(1)  # as the worker (testing.fleet.base_env: OMP_NUM_THREADS=1)
            # 3. The same folder loaded here as the worker loads it.
            loaded = load_pipeline(str(folder), device=device, cache_dir=root / "models")
            info["dtype"] = str(loaded.dtype).removeprefix("torch.")
            renderer = Renderer(loaded)
            worker.ready(timeout=max(1.0, deadline - time.monotonic()))
            # 4. Warm-ups, then the turns.
            path = write_prompts(root / "prompts.txt", prompts, "prompt")
            pipeline_rate(renderer, arch, batch, batch, 10**6, cuda)
            warm = write_prompts(root / "warm.txt", batch, "warm-up")
            worker.job(warm, arch, batch=batch, seed=10**6, deadline=deadline)
            pipe_rates: list[float] = []
            worker_rates: list[float] = []
            for run in range(runs):
                turn = prompts / pipe_rates[-1] + prompts / worker_rates[-1] if pipe_rates else 0.0
                if run and time.monotonic() + turn > deadline:
                    log(f"{arch.name}: turn {run} skipped: time budget")
                    break
                pipe_rates.append(pipeline_rate(renderer, arch, prompts, batch, run, cuda))
                worker_rates.append(prompts / worker.job(path, arch, batch=batch, seed=run, deadline=deadline))
                log(f"{arch.name} turn {run}: pipeline {pipe_rates[-1]:.3f} images/s, worker {worker_rates[-1]:.3f}")
        finally:
            torch.set_num_threads(threads)
            worker.stop()
    pipe, work = statistics.median(pipe_rates), statistics.median(worker_rates)
    info.update(pipeline_images_per_second=pipe, worker_images_per_second=work, ratio=work / pipe, runs=len(pipe_rates))
    info.update(pipeline_runs=pipe_rates, worker_runs=worker_rates)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="toy sizes on any device (proves the path runs)")
    parser.add_argument("--runs", type=int, default=None, help=f"turns of each side (median; default {RUNS}, --tiny 1)")
    parser.add_argument("--budget-seconds", type=float, default=3600.0, help="turns that would end past it are skipped")
    parser.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)

    from worker.accounting.speeds import card_name
    from worker.render.models import default_device

    started = time.monotonic()
    device = args.device or default_device()

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a folder model: nothing to fetch
    quiet_progress_bars()
    runs = max(1, args.runs or (1 if args.tiny else RUNS))
    info = run_worker_path(tiny_sizes=args.tiny, device=device, runs=runs, budget=args.budget_seconds, log=log)
    info.update(card=card_name(device), device=device, tiny=args.tiny, wall_seconds=time.monotonic() - started)
    print(format_worker(info))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(info, indent=2))
    return 0


def quiet_progress_bars() -> None:
    """No save or load progress bars in the run's output (diffusers' and transformers' own)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def format_worker(info: dict[str, Any]) -> str:
    """One line: the worker's images/s, the pipeline's, the ratio, and what was measured."""
    return (
        f"worker path: {info['model']} {info['size']}, {info['steps']} steps, batch {info['batch']}, {info['mode']}, "
        f"{info.get('dtype', '?')}: worker {info['worker_images_per_second']:.3f} images/s, pipeline "
        f"{info['pipeline_images_per_second']:.3f} images/s, ratio {info['ratio']:.3f} (median of {info['runs']} "
        f"turns of {info['prompts']} prompts)"
    )


if __name__ == "__main__":
    sys.exit(main())
