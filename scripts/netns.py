"""Two machines on one box for the multi-machine tests and trials: network namespaces joined by a veth pair.

Each has its own address, interface and hostname (unshare --uts), and its own /etc/hosts (/etc/netns/NAME/hosts,
which `ip netns exec` mounts over /etc/hosts) mapping that hostname to 127.0.1.1, as Debian does: what makes
Paddle's launcher and gloo need --host and GLOO_SOCKET_IFNAME. Needs root, iproute2 and util-linux; nft (Debian's
nftables) for partitions.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Host:
    """One machine: a network namespace with one end of a veth pair, and a hostname that resolves to 127.0.1.1
    in its own /etc/hosts (/etc/netns/NAME/hosts, which `ip netns exec` mounts over /etc/hosts), as on Debian."""

    netns: str
    address: str
    interface: str

    @property
    def hostname(self) -> str:
        return self.netns

    def command(self, argv: list[str]) -> list[str]:
        """argv run on this machine: in its namespace, with its /etc/hosts and (unshare --uts) its hostname."""
        set_hostname = 'hostname "$0" && exec "$@"'
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c", set_hostname, self.hostname, *argv]

    def pids(self) -> list[int]:
        """The processes running on this machine (in its network namespace)."""
        found = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True, timeout=10)
        return [int(pid) for pid in found.stdout.split()]

    def kill_all(self) -> list[int]:
        """SIGKILL every process on this machine, as when it loses power; returns their pids."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def nft(self, script: str) -> None:
        """nftables rules inside this machine's namespace (a partition: drop what goes to or comes from a peer)."""
        cmd = ["ip", "netns", "exec", self.netns, "nft", "-f", "-"]
        subprocess.run(cmd, input=script, text=True, check=True, capture_output=True, timeout=10)


def namespaces_problem() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "unshare", "hostname") if not shutil.which(tool)]
    return f"network namespaces need {', '.join(missing)} (iproute2, util-linux, hostname)" if missing else None


_made = itertools.count()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextlib.contextmanager
def two_hosts():
    """Two machines, 10.78.0.1 and 10.78.0.2 on one veth pair. Their processes, namespaces (the veth pair goes
    with them) and /etc/netns folders are removed afterwards, whatever happened."""
    tag = f"{os.getpid()}{next(_made)}"
    hosts = (Host(f"pm{tag}a", "10.78.0.1", f"v{tag}a"), Host(f"pm{tag}b", "10.78.0.2", f"v{tag}b"))
    try:
        for host in hosts:
            _ip("netns", "add", host.netns)
            etc = Path("/etc/netns") / host.netns
            etc.mkdir(parents=True)
            (etc / "hosts").write_text(f"127.0.0.1\tlocalhost\n127.0.1.1\t{host.hostname}\n")
        _ip("link", "add", hosts[0].interface, "type", "veth", "peer", "name", hosts[1].interface)
        for host in hosts:
            _ip("link", "set", host.interface, "netns", host.netns)
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.netns, "link", "set", host.interface, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for host in hosts:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                host.kill_all()
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, timeout=10)
            shutil.rmtree(Path("/etc/netns") / host.netns, ignore_errors=True)


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """The processes' exit codes, None for one still running after timeout seconds (it is killed then)."""
    deadline = time.monotonic() + timeout
    while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    codes = [proc.poll() for proc in procs]
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return codes
