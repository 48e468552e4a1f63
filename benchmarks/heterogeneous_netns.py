"""The heterogeneous benchmark on the kernel's path: every rank in a network namespace of its own, each pair's rate
shaped by `tc` (an HTB class per destination address, benchmarks/netns.py), instead of the transport's emulator.

This kernel has no netem, so each pair's latency still comes from the emulator (AQPIPE_LINK_MATRIX's LinkMatrix,
its rates set to infinity: it holds each message back by the latency alone, and paces the collectives by their
latencies); every byte crosses a shaped veth at the scenario's rate. Devices are stretched as in
benchmarks/heterogeneous.py. The same worker runs: the profile `--placement auto` takes (now measuring the kernel's
links), the plan, and measured steps of rank order, the model's best random placements and the plan. Needs root.

    python -m benchmarks.heterogeneous_netns --scenarios two-datacenters --steps 2 --json netns.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.heterogeneous import chosen, run_scenarios, scenarios, worker
from benchmarks.netns import Network, can_build

ROOT = Path(__file__).resolve().parents[1]
WORLD = 8
PORT = 29611


def kernel_rates(table: dict[str, Any], name: str) -> dict[tuple[int, int], str]:
    """Each ordered pair's rate as tc takes it ('11.2mbit'), from the scenario's cluster table."""
    from aqpipe.plan import parse

    links = parse(table, name, WORLD)
    return {(i, j): f"{links.rate[i][j] * 8 / 1e6:.4g}mbit" for i in range(WORLD) for j in range(WORLD) if i != j}


def rank_main(args: argparse.Namespace) -> int:
    """One rank, inside its namespace: join the job over the shaped links, run the benchmark's worker, and rank 0
    writes what every rank measured."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{PORT}", rank=args.rank, world_size=WORLD)
    out = worker(args.rank, WORLD, args.scenario, args.model_dir, args.steps, args.shuffles, args.randoms,
                 kernel=True)
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def run_scenario(name: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    table, _ = scenarios()[name]
    out = model_dir.parent / f"{name.replace(' ', '_').replace(',', '')}.json"
    with Network(WORLD) as net, (model_dir.parent / "ranks.log").open("w") as log:
        rates = kernel_rates(table, name)
        net.shape_links(rates, default=max(rates.values(), key=lambda r: float(r[:-4])))
        procs = []
        path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        for i in range(WORLD):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path,
                   "GLOO_SOCKET_IFNAME": net.interface(i)}
            cmd = [*net.exec_prefix(i), sys.executable, "-m", "benchmarks.heterogeneous_netns", "--rank", str(i),
                   "--scenario", name, "--model_dir", str(model_dir), "--master", net.address(0), "--out", str(out),
                   "--steps", str(args.steps), "--shuffles", str(args.shuffles), "--randoms", str(args.randoms)]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 3600
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.5)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        codes = [p.returncode for p in procs]
        if any(codes):
            log.flush()
            raise RuntimeError(f"{name}: exit codes {codes}:\n{(model_dir.parent / 'ranks.log').read_text()[-3000:]}")
        throughput = {"inside": net.throughput_mbit(0, 1), "across": net.throughput_mbit(0, WORLD - 1)}
    result = json.loads(out.read_text())
    result["tc_measured_mbit"] = throughput
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default="two-datacenters", help="names separated by semicolons, or all")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--shuffles", type=int, default=10)
    p.add_argument("--randoms", type=int, default=100)
    p.add_argument("--json", help="write every figure here")
    # one rank's process, started by the driver inside its namespace
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--scenario", help=argparse.SUPPRESS)
    p.add_argument("--model_dir", help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank is not None:
        return rank_main(args)
    if os.geteuid() != 0 or can_build():
        p.error("network namespaces and tc need root and iproute2 (without them: python -m benchmarks.heterogeneous, "
                "the emulator alone)")
    run_scenarios(chosen(p, args.scenarios), lambda name, model: run_scenario(name, model, args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
