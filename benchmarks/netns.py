"""Emulated machines on one host: a network namespace per pipeline stage, each uplink a shaped link.

Every host i is a namespace with one veth interface (10.77.0.{i+1}/24) whose other end sits on a
bridge in a hub namespace, so every host reaches every other (gloo connects all pairs, and the
rendezvous store lives on host 0). Each host's egress is shaped with a token-bucket qdisc (`tc ...
tbf`), so every direction of every pair is limited to the link rate, as on machines with that
uplink. The kernel here has no netem: latency, when wanted, is added in the transport
(`AQPIPE_LINK_LATENCY_MS`, see aqpipe/pipeline/transport.py).

Needs root and iproute2. `Network` is a context manager: on exit (normal, exception or Ctrl-C) it
kills whatever still runs in its namespaces and deletes them, which removes the links too.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Sequence

SUBNET = "10.77.0"
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_UNIT_BITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bits(rate: str) -> float:
    """'100mbit' -> 1e8 bits/s; raises ValueError naming the value otherwise."""
    m = _RATE.match(rate.strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"link rate {rate!r}: expected a positive number with kbit, mbit or gbit, like 100mbit")
    return float(m.group(1)) * _UNIT_BITS[m.group(2)]


def can_build() -> str | None:
    """None when namespaces can be built here, else why not (for a clear message)."""
    if os.geteuid() != 0:
        return "network namespaces and qdiscs need root (run it as root, or pass --no_netns for loopback)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (install iproute2, or pass --no_netns for loopback)"
    return None


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")
    return proc


class Network:
    """`hosts` namespaces on one bridge; `shape(rate)` sets every host's uplink (None: unshaped)."""

    def __init__(self, hosts: int, tag: str | None = None) -> None:
        if hosts < 2:
            raise ValueError(f"hosts={hosts}: a link needs at least 2")
        if hosts > 250:
            raise ValueError(f"hosts={hosts}: at most 250 fit the /24 subnet")
        self.hosts = hosts
        self.tag = tag or f"aqp{os.getpid() % 100000}"
        self.hub = f"{self.tag}hub"
        self.rate: str | None = None

    def namespace(self, i: int) -> str:
        return f"{self.tag}h{i}"

    def interface(self, i: int) -> str:
        return f"{self.tag}v{i}"  # <= 15 characters, the kernel's limit

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def exec_prefix(self, i: int) -> list[str]:
        """Prefix a command with this to run it on host i."""
        return ["ip", "netns", "exec", self.namespace(i)]

    def up(self) -> "Network":
        _run(["ip", "netns", "add", self.hub])
        hub = ["ip", "-n", self.hub]
        _run([*hub, "link", "add", "br0", "type", "bridge"])
        _run([*hub, "link", "set", "br0", "up"])
        for i in range(self.hosts):
            ns, dev, port = self.namespace(i), self.interface(i), f"{self.tag}p{i}"
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.hub])
            _run([*hub, "link", "set", port, "master", "br0"])
            _run([*hub, "link", "set", port, "up"])
            host = ["ip", "-n", ns]
            _run([*host, "addr", "add", f"{self.address(i)}/24", "dev", dev])
            _run([*host, "link", "set", dev, "up"])
            _run([*host, "link", "set", "lo", "up"])
            self._name_service(ns)
        return self

    def _name_service(self, ns: str) -> None:
        """`ip netns exec` mounts /etc/netns/NS/{hosts,resolv.conf} over /etc: no DNS server is reachable
        from a namespace, and without these every hostname lookup (c10d does several) waits out resolver timeouts."""
        folder = Path("/etc/netns") / ns
        folder.mkdir(parents=True, exist_ok=True)
        names = "".join(f"{self.address(i)} {self.namespace(i)}\n" for i in range(self.hosts))
        (folder / "hosts").write_text(f"127.0.0.1 localhost {socket.gethostname()}\n{names}")
        (folder / "resolv.conf").write_text("options timeout:1 attempts:1\n")

    def shape(self, rate: str | None) -> None:
        """Token-bucket shape every host's egress to `rate` (e.g. '100mbit'); None removes the shaping."""
        for i in range(self.hosts):
            tc = ["ip", "netns", "exec", self.namespace(i), "tc", "qdisc"]
            if rate is None:
                _run([*tc, "del", "dev", self.interface(i), "root"], check=False)  # absent already: fine
                continue
            # the bucket must hold at least one timer tick of traffic; 16 KiB keeps slow links smooth
            burst = max(16 * 1024, int(rate_bits(rate) / 8 / 250))
            _run([*tc, "replace", "dev", self.interface(i), "root", "tbf", "rate", rate,
                  "burst", str(burst), "latency", "50ms"])
        self.rate = rate

    def shape_links(self, rates: dict[tuple[int, int], str], default: str) -> None:
        """Each host's egress to host j at rates[(i, j)], to every other host at `default`: one slow link among
        fast ones (an HTB class per destination, a u32 filter on its address; the rest, ARP included, default)."""
        for i in range(self.hosts):
            dev = self.interface(i)
            tc = ["ip", "netns", "exec", self.namespace(i), "tc"]
            _run([*tc, "qdisc", "del", "dev", dev, "root"], check=False)
            _run([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "999"])
            classes = {999: default, **{10 + j: rate for (src, j), rate in rates.items() if src == i}}
            for minor, rate in classes.items():
                burst = max(16 * 1024, int(rate_bits(rate) / 8 / 250))
                _run([*tc, "class", "add", "dev", dev, "parent", "1:", "classid", f"1:{minor}", "htb", "rate", rate,
                      "burst", str(burst), "cburst", str(burst)])
            for (src, j) in rates:
                if src == i:
                    _run([*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                          "match", "ip", "dst", f"{self.address(j)}/32", "flowid", f"1:{10 + j}"])
        self.rate = f"{default}, " + ", ".join(f"{i}->{j} {r}" for (i, j), r in sorted(rates.items()))

    def throughput_mbit(self, src: int = 0, dst: int = 1, nbytes: int = 4 << 20, port: int = 29999) -> float:
        """Measured Mbit/s of one TCP stream from host src to host dst (what the shaping really gives)."""
        receiver = ("import socket,sys\n"
                    f"s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('{self.address(dst)}',{port}));s.listen(1)\n"
                    "print('ready',flush=True)\nc,_=s.accept();n=0\n"
                    "while True:\n  b=c.recv(1<<20)\n  if not b: break\n  n+=len(b)\n"
                    "print(n,flush=True)")
        sender = ("import socket,time\n"
                  f"c=socket.create_connection(('{self.address(dst)}',{port}));d=b'x'*(1<<20);t=time.perf_counter()\n"
                  f"for _ in range({max(1, nbytes >> 20)}): c.sendall(d)\n"
                  "c.shutdown(socket.SHUT_WR);c.recv(1);print(time.perf_counter()-t)")
        rx = subprocess.Popen([*self.exec_prefix(dst), sys.executable, "-c", receiver],
                              stdout=subprocess.PIPE, text=True)
        try:
            rx.stdout.readline()  # 'ready'
            out = subprocess.run([*self.exec_prefix(src), sys.executable, "-c", sender], capture_output=True,
                                 text=True, timeout=600, check=True)
            seconds = float(out.stdout.strip())
        finally:
            rx.kill()
            rx.wait()
        return max(1, nbytes >> 20) * (1 << 20) * 8 / seconds / 1e6

    def down(self) -> None:
        """Kill what runs inside, delete the namespaces (their veths go with them). Never raises."""
        for ns in [*(self.namespace(i) for i in range(self.hosts)), self.hub]:
            pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            _run(["ip", "netns", "del", ns], check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)

    def exists(self) -> bool:
        names = _run(["ip", "netns", "list"], check=False).stdout
        return any(line.split()[0] in {self.hub, self.namespace(0)} for line in names.splitlines() if line.strip())

    def __enter__(self) -> "Network":
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc: object) -> None:
        self.down()
