"""Before a multi-machine job, on each machine: what Paddle's launcher and gloo will see here, one line per finding.

    python -m paddle_mnist.preflight --nnodes 2 --master 10.0.0.1:8090 --output-dir /shared/run1

Paddle's launcher takes this machine's address from its hostname (socket.gethostbyname(socket.getfqdn()) in
launch/context/node.py) unless --host is given, and serves --master only on the machine whose address that is
(launch/controllers/master.py): a hostname that resolves to loopback (Debian's /etc/hosts gives 127.0.1.1) leaves
the master unserved, and every launcher prints "master not ready" forever. gloo, the CPU workers' collectives,
takes its address from the hostname too unless GLOO_SOCKET_IFNAME names an interface (ProcessGroupGloo's
createDefaultDevice). Exit status 1 when the job would hang or fail, 0 otherwise. Nothing here imports Paddle.
"""

from __future__ import annotations

import argparse
import array
import fcntl
import ipaddress
import os
import shutil
import socket
import struct
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

MARKER_PREFIX = ".preflight-"
CONNECT_TIMEOUT_S = 3.0
LOW_DISK_BYTES = 1 << 30
SIOCGIFADDR = 0x8915  # <linux/sockios.h>: an interface's IPv4 address


@dataclass(frozen=True)
class Finding:
    level: str  # "ok", "note" (cannot tell yet), "warning" or "error" (the job would hang or fail)
    text: str

    def line(self) -> str:
        return f"{self.level}: {self.text}"


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def launcher_address() -> tuple[str, str]:
    """(hostname, address) as paddle.distributed.launch finds them without --host (Node.get_host_ip)."""
    hostname = socket.gethostname()
    try:
        return hostname, socket.gethostbyname(socket.getfqdn(hostname))
    except OSError:
        return hostname, "127.0.0.1"  # the launcher's own fallback


def gloo_address() -> str:
    """The address gloo advertises without GLOO_SOCKET_IFNAME: the first of the hostname's that binds, else
    127.0.0.1 (createDefaultDevice in Paddle's process_group_gloo.cc)."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        return "127.0.0.1"
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind((address[0], 0))
                return address[0]
        except OSError:
            continue
    return "127.0.0.1"


def interfaces() -> dict[str, str]:
    """This machine's interfaces that have an IPv4 address: name -> address."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = array.array("B", struct.pack("256s", name.encode()[:15]))
            try:
                fcntl.ioctl(s.fileno(), SIOCGIFADDR, request)
            except OSError:  # no IPv4 address
                continue
            found[name] = socket.inet_ntoa(request.tobytes()[20:24])
    return found


def route_source(ip: str) -> str | None:
    """The address this machine sends from to reach ip (the kernel's route; a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return s.getsockname()[0]
    except OSError:
        return None


@dataclass(frozen=True)
class Machine:
    """What this machine looks like to the launcher and to gloo."""

    hostname: str
    launcher_ip: str  # from the hostname
    gloo_ip: str  # from the hostname, when GLOO_SOCKET_IFNAME is unset
    addresses: dict[str, str]  # interface -> IPv4 address
    source: str | None  # this machine's address on the route to the master

    @classmethod
    def here(cls, master_ip: str) -> Machine:
        hostname, launcher_ip = launcher_address()
        return cls(hostname, launcher_ip, gloo_address(), interfaces(), route_source(master_ip))

    def interface_of(self, address: str | None) -> str | None:
        return next((name for name, a in self.addresses.items() if a == address), None)


def address_findings(
    m: Machine, master_ip: str, nnodes: int, host: str | None, device: str, environ: Mapping[str, str]
) -> list[Finding]:
    """This machine's address as the launcher and gloo (or NCCL) will take it, and the interface to the master."""
    src, iface = m.source, m.interface_of(m.source)
    is_master = master_ip in m.addresses.values() or is_loopback(master_ip)
    found: list[Finding] = []
    env_name = "GLOO_SOCKET_IFNAME" if device == "cpu" else "NCCL_SOCKET_IFNAME"
    fix = f"pass --host {src} to paddle.distributed.launch"
    fix += "" if environ.get(env_name) else f" and set {env_name}={iface}"
    if host is not None:
        if host not in m.addresses.values():
            have = ", ".join(f"{a} ({n})" for n, a in m.addresses.items())
            found.append(Finding("error", f"--host {host} is not an address of this machine (it has {have})"))
        else:
            found.append(Finding("ok", f"the launcher will take this machine's address from --host: {host}"))
    elif nnodes > 1 and is_loopback(m.launcher_ip):
        found.append(
            Finding(
                "error",
                f"hostname {m.hostname!r} resolves to {m.launcher_ip}, a loopback address; paddle.distributed.launch "
                "takes this machine's address from it, so no launcher serves --master and every one prints "
                f"'master not ready' forever: {fix}",
            )
        )
    elif nnodes > 1 and is_master and m.launcher_ip != master_ip:
        found.append(
            Finding(
                "error",
                f"this machine holds --master {master_ip}, but the launcher takes its address from hostname "
                f"{m.hostname!r} ({m.launcher_ip}) and serves --master only when the two match, so it would wait "
                f"for a master nobody serves: pass --host {master_ip} to paddle.distributed.launch",
            )
        )
    else:
        found.append(
            Finding(
                "ok",
                f"the launcher will take this machine's address from hostname {m.hostname!r}: {m.launcher_ip}",
            )
        )
    if iface is None:
        found.append(
            Finding("warning", f"no interface of this machine holds the address ({src}) that routes to {master_ip}")
        )
    else:
        found.append(
            Finding(
                "ok",
                f"{master_ip} is reached through {iface} ({src}): the interface the workers should use "
                f"(GLOO_SOCKET_IFNAME={iface} on CPU, NCCL_SOCKET_IFNAME={iface} on GPUs)",
            )
        )
    found.extend(_collective_findings(m, nnodes, device, environ, iface))
    return found


def _collective_findings(
    m: Machine, nnodes: int, device: str, environ: Mapping[str, str], iface: str | None
) -> list[Finding]:
    """The address the workers' collectives advertise: gloo's (CPU) from GLOO_SOCKET_IFNAME or the hostname."""
    name = "GLOO_SOCKET_IFNAME" if device == "cpu" else "NCCL_SOCKET_IFNAME"
    chosen = environ.get(name, "")
    if chosen:
        # NCCL reads a comma-separated list of prefixes, ^ to exclude, = for exact names; gloo one exact name
        first = chosen.lstrip("^=").split(",")[0]
        if device == "cpu" and chosen not in m.addresses:
            have = ", ".join(m.addresses)
            return [Finding("error", f"{name}={chosen}: this machine has no such interface with an address ({have})")]
        if iface and first != iface and not chosen.startswith("^"):
            return [Finding("warning", f"{name}={chosen}, but the route to the master leaves through {iface}")]
        return [Finding("ok", f"{name}={chosen}: the workers' collectives use that interface")]
    if device != "cpu":
        return [Finding("ok", f"{name} is unset: NCCL picks an interface itself (never loopback); set it to choose")]
    if nnodes > 1 and is_loopback(m.gloo_ip):
        return [
            Finding(
                "error",
                f"GLOO_SOCKET_IFNAME is unset, so gloo (the CPU workers' collectives) advertises {m.gloo_ip}, the "
                f"address of hostname {m.hostname!r}: the other machines cannot connect to a loopback address "
                "(connection refused, or a timeout), even with --host; "
                f"set GLOO_SOCKET_IFNAME={iface or '<interface>'}",
            )
        ]
    return [Finding("ok", f"GLOO_SOCKET_IFNAME is unset: gloo advertises {m.gloo_ip}, the address of the hostname")]


def master_finding(master_ip: str, port: int, m: Machine, nnodes: int) -> Finding:
    """On the master's machine: the port free for the launcher's server. Elsewhere: the master's machine answers."""
    if master_ip in m.addresses.values() or is_loopback(master_ip):
        if nnodes > 1 and is_loopback(master_ip):
            return Finding(
                "error",
                f"--master {master_ip}:{port} is a loopback address, which the other machines cannot reach: "
                f"pass this machine's address, --master {m.source or '<address>'}:{port}",
            )
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the launcher's HTTP server does
            try:
                s.bind((master_ip, port))
            except OSError as e:
                return Finding(
                    "error",
                    f"this is the master's machine, and port {port} is taken ({e.strerror}): the launcher would "
                    "talk to whatever holds it instead of serving the job; stop it or pick another port for --master",
                )
        return Finding("ok", f"this is the master's machine ({master_ip}) and port {port} is free for the launcher")
    try:
        with socket.create_connection((master_ip, port), timeout=CONNECT_TIMEOUT_S):
            return Finding("ok", f"--master {master_ip}:{port} is reachable and something listens there")
    except ConnectionRefusedError:
        return Finding(
            "ok",
            f"--master {master_ip}:{port} is reachable (its machine answered; nothing listens on {port} until the "
            "launcher there starts)",
        )
    except OSError as e:
        why = "no answer within 3 s" if isinstance(e, socket.timeout) else (e.strerror or str(e))
        return Finding(
            "error",
            f"cannot reach --master {master_ip}:{port} from here ({why}): check the address, the route "
            f"(ip route get {master_ip}) and any firewall between the machines",
        )


def output_findings(out: Path, m: Machine) -> list[Finding]:
    """The output directory: writable, shared with the other machines (markers), free space."""
    marker = out / f"{MARKER_PREFIX}{m.hostname}-{m.source or m.launcher_ip}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{m.hostname} {m.source or m.launcher_ip} {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    except OSError as e:
        return [Finding("error", f"cannot write to --output-dir {out} ({e.strerror}); pass a writable folder")]
    found = [Finding("ok", f"--output-dir {out} is writable (left {marker.name} there for the other machines)")]
    others = sorted(p.name[len(MARKER_PREFIX) :] for p in out.glob(f"{MARKER_PREFIX}*") if p != marker)
    if others:
        found.append(Finding("ok", f"--output-dir is shared: it holds the markers of {', '.join(others)}"))
    else:
        found.append(
            Finding(
                "note",
                f"no other machine's marker in {out} yet, so whether the machines share it cannot be told; run this "
                "check on the other machines, then here again: a shared folder then lists them (a resumed job needs "
                "it shared: every worker reads rank 0's checkpoint)",
            )
        )
    free = shutil.disk_usage(out).free
    level = "warning" if free < LOW_DISK_BYTES else "ok"
    found.append(Finding(level, f"{free / 2**30:.1f} GiB free in {out}"))
    return found


def check(
    master: str, output_dir: Path, nnodes: int, host: str | None, device: str, environ: Mapping[str, str]
) -> list[Finding]:
    ip, port = parse_master(master)
    m = Machine.here(ip)
    return [
        *address_findings(m, ip, nnodes, host, device, environ),
        master_finding(ip, port, m, nnodes),
        *output_findings(output_dir, m),
    ]


class UsageError(ValueError):
    pass


def parse_master(master: str) -> tuple[str, int]:
    ip, _, port = master.rpartition(":")
    try:
        ipaddress.ip_address(ip)
        number = int(port)
    except ValueError:
        raise UsageError(f"--master takes IP:PORT, e.g. --master 10.0.0.1:8090; got {master!r}") from None
    if not 0 < number < 65536:
        raise UsageError(f"--master's port is between 1 and 65535; got {port}")
    return ip, number


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m paddle_mnist.preflight",
        description="Run on each machine before a multi-machine job, with the launcher's --master and the trainer's "
        "--output-dir: one line per finding; exit status 1 when the job would hang or fail.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--master", required=True, help="the launcher's --master, IP:PORT")
    p.add_argument("--output-dir", required=True, help="the trainer's --output-dir")
    p.add_argument("--nnodes", type=int, default=2, help="the launcher's --nnodes")
    p.add_argument("--host", help="the launcher's --host, if you will pass it")
    p.add_argument(
        "--device", choices=("cpu", "gpu"), default="cpu", help="what the workers run on: gloo (cpu) or NCCL (gpu)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        findings = check(args.master, Path(args.output_dir), args.nnodes, args.host, args.device, os.environ)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for finding in findings:
        print(finding.line(), flush=True)
    return 1 if any(f.level == "error" for f in findings) else 0


LAUNCHER_VALUES = ("--nnodes", "--master", "--host", "--gpus", "--devices", "--selected_gpus")


def launcher_options(argv: list[str]) -> dict[str, str]:
    """The values of LAUNCHER_VALUES in a paddle.distributed.launch command line (--opt V or --opt=V), read up to
    the training script (the first argument ending in .py): the trainer's own flags after it are not the
    launcher's."""
    found: dict[str, str] = {}
    for i, arg in enumerate(argv):
        if arg.endswith(".py") and not arg.startswith("-"):
            break
        name, eq, value = arg.partition("=")
        if name in LAUNCHER_VALUES:
            found[name] = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    return found


def launch_problems(argv: list[str], environ: Mapping[str, str]) -> list[str]:
    """What in a paddle.distributed.launch command line would make a multi-machine job hang or fail on this
    machine, found before the launcher starts (address_findings' errors): empty where it would not, and for a
    job whose launchers are all on this machine (one launcher, or a --master on loopback)."""
    options = launcher_options(argv)
    try:
        nnodes = int(options.get("--nnodes", "1").split(":")[-1])
    except ValueError:
        return []  # the launcher's own parser says what is wrong with it
    master = options.get("--master", "")
    if nnodes < 2 or not master or "://" in master:  # an etcd:// master: the launcher finds the others there
        return []
    try:
        master_ip, _ = parse_master(master)
    except UsageError as e:
        return [str(e)]
    if is_loopback(master_ip):  # every launcher is on this machine, and loopback serves them all
        return []
    gpus = any(options.get(name) for name in ("--gpus", "--devices", "--selected_gpus"))
    device = "gpu" if gpus else "cpu"
    findings = address_findings(Machine.here(master_ip), master_ip, nnodes, options.get("--host"), device, environ)
    return [f.text for f in findings if f.level == "error"]


def startup_problem(environ: Mapping[str, str]) -> str | None:
    """At a CPU worker's start, before it joins the process group: why gloo cannot connect across machines.

    Only for a job whose workers are on several hosts (a job of several launchers on one machine works on
    loopback): then a hostname on loopback and no GLOO_SOCKET_IFNAME make gloo advertise an address no other
    machine can reach.
    """
    endpoints = [e for e in environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",") if e.strip()]
    hosts = {e.strip().rsplit(":", 1)[0] for e in endpoints}
    if len(hosts) < 2 or environ.get("GLOO_SOCKET_IFNAME", ""):
        return None
    gloo_ip = gloo_address()
    if not is_loopback(gloo_ip):
        return None
    here = environ.get("PADDLE_CURRENT_ENDPOINT", "").rsplit(":", 1)[0]
    iface = Machine.here(here).interface_of(here) if here else None
    return (
        f"this job spans {len(hosts)} machines, but GLOO_SOCKET_IFNAME is unset and hostname "
        f"{socket.gethostname()!r} resolves to {gloo_ip}, so gloo would advertise that loopback address and the "
        f"other machines could not connect (connection refused, or a timeout); set GLOO_SOCKET_IFNAME="
        f"{iface or '<interface>'} for the launcher on this machine (python -m paddle_mnist.preflight checks a "
        "machine before a job)"
    )


if __name__ == "__main__":
    sys.exit(main())
