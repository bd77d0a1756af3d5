"""Training on several processes (torchrun): starting them, and what each one does differently.

``run(fn, job, rt, processes)`` calls ``fn(job, rt)`` in this process when ``processes`` is 1. Else it
writes ``job`` (JSON) into the stage's workdir and starts ``torchrun`` (``python -m
torch.distributed.run --standalone``) on this module: every process joins the process group (gloo on
CPU, nccl on CUDA, where process i computes on ``cuda:LOCAL_RANK``) and calls the same ``fn(job, rt)``
with its own runtime. ``irflow.learn.training.train_loop`` sees the process group: each process computes
the loss of its share of every batch (``share_of``), gradients are averaged over processes after each
backward (``average_gradients``: what DDP does), rank 0 reports the whole batch's loss and writes the
checkpoints, which every process reads on resume. The trainer's ``fn`` has rank 0 save the model.

A share's loss is the mean over its rows; scaled by ``rows * processes / batch`` (1 when the batch
splits evenly), the averaged gradient is the gradient of the mean over the whole batch: N processes
take the same step as one process with the whole batch (floating-point noise aside; dropout masks
differ). Losses with in-batch negatives gather every process's passages
(``irflow.learn.losses.gather_across_processes``), which needs equal shares.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

from irflow.engine.runtime import StageRuntime

log = logging.getLogger("irflow.train")


def rank_and_world() -> tuple[int, int]:
    """(this process's rank, number of processes); (0, 1) outside a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_split(batch: int, processes: int, what: str = "batch_size") -> None:
    """Refuse a batch that ``runtime.train_processes`` cannot split into equal shares."""
    if batch % processes:
        raise ValueError(f"runtime.train_processes: {processes} processes cannot split a batch of {batch} "
                         f"({what}) into equal shares; use a divisor of {batch}")


def share_of(batch: list[int], rank: int, world: int) -> tuple[list[int], float]:
    """(this process's contiguous share of ``batch``, the weight of its mean loss). Shares differ in size
    only when the whole dataset is smaller than one batch."""
    if world == 1:
        return batch, 1.0
    if len(batch) < world:
        raise ValueError(f"runtime.train_processes: {world} processes, but a batch has {len(batch)} rows "
                         f"(the whole dataset): every process needs at least one")
    size, extra = divmod(len(batch), world)
    start = rank * size + min(rank, extra)
    share = batch[start:start + size + (rank < extra)]
    return share, len(share) * world / len(batch)


def average_gradients(model, world: int) -> None:
    """DDP's all-reduce, done by hand: trainers call the model several times per step (queries,
    passages, GradCache's chunks), which DDP's hooks do not expect."""
    import torch.distributed as dist

    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= world


def mean_over_processes(value, world: int) -> float:
    """The mean of a scalar tensor over processes (itself with one process)."""
    if world == 1:
        return float(value)
    import torch.distributed as dist

    value = value.detach().float().clone()  # all_reduce works in place
    dist.all_reduce(value)
    return float(value) / world


def run(fn: Callable[[dict, StageRuntime], None], job: dict, rt: StageRuntime, processes: int) -> None:
    """``fn(job, rt)`` here (one process) or in ``processes`` torchrun workers; ``job`` must be JSON."""
    if processes == 1:
        fn(job, rt)
        return
    if rt.device.startswith("cuda"):
        import torch

        if processes > torch.cuda.device_count():
            raise ValueError(f"runtime.train_processes (or the dual encoder's processes): {processes} "
                             f"processes on CUDA take one GPU each, but there are {torch.cuda.device_count()}")
    threads = max(1, rt.threads // processes)
    spec = Path(rt.workdir) / "train_job.json"
    spec.write_text(json.dumps({"fn": f"{fn.__module__}:{fn.__qualname__}", "job": job,
                                "runtime": {**asdict(replace(rt, threads=threads)),
                                            "workdir": str(rt.workdir),
                                            "resume_dir": str(rt.resume_dir) if rt.resume_dir else None}}))
    _torchrun(spec, processes, threads)


def _torchrun(spec: Path, processes: int, threads: int) -> None:
    from irflow.engine.processes import dying_with_parent

    # OMP_NUM_THREADS: torchrun would otherwise set 1; the processes share the stage's threads.
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
           "-m", "irflow.engine.distributed", str(spec)]
    log_path = spec.with_name("torchrun.log")  # the whole output, beside the job, whatever happened
    for attempt in (1, 2):
        log.info("training on %d processes: %s", processes, " ".join(cmd[2:]))
        argv, dying = dying_with_parent(cmd)
        proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **dying)
        log_path.write_text(proc.stdout)
        if proc.returncode == 0:
            break
        signal = _killing_signal(proc.stdout)
        # Once, a CI run saw rank 1 die of SIGABRT in its first step, never seen again in 20 runs here. A
        # process killed by a signal other than ours (an abort in gloo's native code) gets one more try
        # with a fresh process group (resuming from rank 0's last checkpoint when there is one); a Python
        # error is reported at once. Not torchrun's --max-restarts: its restarted group failed to
        # connect here (gloo connectFullMesh: connection refused).
        if attempt == 1 and signal is not None and signal not in (2, 9, 15):
            log.warning("a training process died of signal %d; starting the %d processes again once "
                        "(output of the failed try: %s)", signal, processes, log_path)
            log_path.rename(log_path.with_name("torchrun.failed.log"))
            continue
        # The message keeps what says why: a process's own error lines (a C++ abort prints "terminate
        # called ..." / "what(): ..." long before torchrun's summary) and the summary's end.
        lines = proc.stdout.strip().splitlines()
        why = [line for line in lines[:-40] if _SAYS_WHY.search(line)][:20]
        tail = "\n".join(why + ["..."] * bool(why) + lines[-40:])
        raise RuntimeError(f"torchrun with {processes} processes failed (rc {proc.returncode}; "
                           f"its whole output: {log_path}):\n{tail}")
    for line in proc.stdout.splitlines()[-5:]:
        log.debug("torchrun: %s", line)


def _killing_signal(output: str) -> int | None:
    """The signal that killed one of the processes, other than a stop (2, 9, 15), if one did.

    Not only torchrun's "Root Cause": when rank 1 aborts, rank 0 can see its socket close and exit 1
    before torchrun notices the abort, and torchrun then names rank 0 and stops rank 1 itself (seen in
    CI). So every failure's exit code counts, and so does an abort's own line in the output."""
    codes = {-int(c) for c in re.findall(r"exitcode\s*:\s*(-\d+)", output)} - {2, 9, 15}
    if codes:
        return min(codes)
    for line, sig in (("Fatal Python error: Aborted", 6), ("Fatal Python error: Segmentation fault", 11),
                      ("terminate called", 6)):
        if line in output:
            return sig
    return None


_SAYS_WHY = re.compile(r"terminate called|what\(\)|Error|Exception|Aborted|Signal|gloo", re.I)


def _worker(spec_path: str) -> None:
    import torch
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    module, name = spec["fn"].split(":")
    fn = getattr(importlib.import_module(module), name)
    rt = StageRuntime(**{**spec["runtime"], "workdir": Path(spec["runtime"]["workdir"]),
                         "resume_dir": Path(spec["runtime"]["resume_dir"]) if spec["runtime"]["resume_dir"] else None})
    if rt.device.startswith("cuda"):
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        rt = replace(rt, device=f"cuda:{local}")
    dist.init_process_group("nccl" if rt.device.startswith("cuda") else "gloo")
    torch.set_num_threads(rt.threads)
    try:
        fn(spec["job"], rt)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    # record: torchrun's failure summary then carries the process's exception, not just "exitcode 1"
    record(_worker)(sys.argv[1])
