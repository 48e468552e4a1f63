"""Processes a test starts: gloo ranks (`spawn`, forked from a server that preloaded torch and the libraries), and
launched commands that import this checkout (`checkout_env`). Worker functions are found by module name."""
from __future__ import annotations

import io
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


ROOT = Path(__file__).resolve().parents[2]  # the checkout


def checkout_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment of a process a test starts: it imports this checkout (first on PYTHONPATH), not an installed
    copy or whatever else the caller's path holds; one thread per process; unbuffered output. `extra` overrides."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Workers fork from a server that imported these once: torch, transformers and PEFT (with bitsandbytes, which PEFT
# imports where it is installed) cost a worker 3-8 s of imports, a spawn 0.1 s from here. The server was started with
# the first test's environment, so each worker takes the test's own at its start (_entry; multiprocessing sets the
# directory).
PRELOAD = ["torch", "torch.distributed", "transformers", "peft", "aqpipe.pipeline", "aqpipe.data_parallel",
           "aqpipe.compression", "aqpipe.settings", "aqpipe.models", "aqpipe.data", "aqpipe.train", __name__]


def _entry(fn: Callable, rank: int, world: int, port: int, queue: Any, args: tuple, environ: dict[str, str]
           ) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        buf = io.BytesIO()  # bytes, not shared-memory tensors: those vanish when this process exits
        torch.save(fn(rank, world, *args), buf)
        queue.put((rank, buf.getvalue(), None))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # report, so the parent sees why, and exit non-zero
        queue.put((rank, None, traceback.format_exc()))
        raise


def spawn(fn: Callable, world: int, *args: Any, timeout: float = 180) -> list[Any]:
    """fn(rank, world, *args) on `world` processes; returns the results by rank.

    Raises naming the rank that failed: an error it reported (also one reported after its result, at the closing
    barrier), or a process that ended with a status other than 0 (one that `os._exit`s after returning, say)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, queue, args, dict(os.environ)))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        while len(results) + len(errors) < world:
            rank, value, error = queue.get(timeout=timeout)
            if error:
                errors.setdefault(rank, error)
                break  # the others may wait for it forever
            results[rank] = value
        for p in procs:
            p.join(timeout=30 if not errors else 5)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    exited = all(p.exitcode is not None for p in procs)  # an exited worker's reports are all in the pipe already
    while True:  # late reports: an error at the closing barrier comes after the rank's result
        try:
            rank, _, error = queue.get(timeout=0.05 if exited else 0.5)
        except Exception:  # noqa: BLE001 - queue.Empty: drained
            break
        if error:
            errors.setdefault(rank, error)
    if errors:  # every rank that reported one, the cause first: a peer's lost connection is a consequence
        echo = ("Connection reset by peer", "Connection closed by peer", "Timed out")
        ranks = sorted(errors, key=lambda r: any(e in errors[r] for e in echo))
        raise RuntimeError("\n".join(f"rank {r} failed:\n{errors[r]}" for r in ranks))
    for rank, p in enumerate(procs):
        if p.exitcode != 0:
            raise RuntimeError(f"rank {rank} failed: its process ended with status {p.exitcode}")
    return [torch.load(io.BytesIO(results[r]), weights_only=False) for r in range(world)]  # our own workers' results


class Launched:
    """What a launch of `aqpipe` left: its exit status (the first rank's that failed, else 0) and every rank's
    standard error and output, rank by rank (as torchrun interleaves them, without the prefixes)."""

    def __init__(self, returncode: int, stderr: str, stdout: str) -> None:
        self.returncode, self.stderr, self.stdout = returncode, stderr, stdout


def _aqpipe_rank(argv: list[str], rank: int, world: int, port: int, environ: dict[str, str], logs: str) -> None:
    """One rank of `launch_aqpipe`: the launcher's environment, its output to files, `aqpipe.cli.main`, exit."""
    from aqpipe.cli import main

    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", ROLE_RANK=str(rank),
                      TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none")
    torch.set_num_threads(int(environ.get("OMP_NUM_THREADS", "1")))  # what a fresh rank's OMP_NUM_THREADS gives
    for fd, name in ((1, "out"), (2, "err")):
        with open(os.path.join(logs, f"{name}.{rank}"), "w") as f:
            os.dup2(f.fileno(), fd)
    for stream in (sys.stdout, sys.stderr):  # PYTHONUNBUFFERED is read at start-up: a rank killed loses nothing
        stream.reconfigure(write_through=True)
    code = 1
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the launch reports it as torchrun would: a traceback and a status
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def launch_aqpipe(argv: list[str], nproc: int, logs: Path, timeout: float = 300, **env: str) -> Launched:
    """`torchrun --nproc_per_node nproc -m aqpipe *argv` on this machine, its ranks forked from the preloaded server
    (a torchrun launch pays each rank's 7 s of imports; this, none): for tests of what a run computes, not of how
    the launcher starts, signals or restarts it (those launch torchrun itself)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    logs.mkdir(parents=True, exist_ok=True)
    port, environ = free_port(), checkout_env(**env)
    procs = [ctx.Process(target=_aqpipe_rank, args=(list(argv), r, nproc, port, environ, str(logs)))
             for r in range(nproc)]
    for p in procs:
        p.start()
    deadline, failed = time.monotonic() + timeout, None
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        failed = next((r for r, p in enumerate(procs) if p.exitcode not in (None, 0)), None)
        if failed is not None:  # torchrun stops the others at a rank's failure: so does this, after a grace
            until = time.monotonic() + 30
            while any(p.is_alive() for p in procs) and time.monotonic() < until:
                time.sleep(0.05)
            break
        time.sleep(0.05)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    if hung and failed is None:
        tails = "\n".join(f"rank {r}: {_log(logs, 'err', r)[-1500:]}" for r in hung)
        raise TimeoutError(f"ranks {hung} still ran after {timeout} s:\n{tails}")
    code = next((p.exitcode for p in procs if p.exitcode != 0), 0)
    first = failed if failed is not None else next((r for r, p in enumerate(procs) if p.exitcode != 0), 0)
    # every rank's words, the failing rank's last: a test's message (stderr[-3000:]) ends with what went wrong
    err = "".join(_log(logs, "err", r) for r in [*(r for r in range(nproc) if r != first), first])
    return Launched(code, err, "".join(_log(logs, "out", r) for r in range(nproc)))


def _log(logs: Path, name: str, rank: int) -> str:
    """What rank `rank` wrote to its standard output ("out") or error ("err"); "" where it wrote nothing."""
    path = logs / f"{name}.{rank}"
    return path.read_text() if path.exists() else ""
