#!/usr/bin/env python3
"""A multi-host Horovod cluster on one machine (run as root).

    sudo .venv/bin/python scripts/cluster.py --hosts 2 --slots 2 -- python train.py ...
    sudo .venv/bin/python scripts/cluster.py --hosts 4 --slots 1 --mpi --rate 1gbit -- ...
    sudo .venv/bin/python scripts/cluster.py --cleanup     # remove what a killed run left

Every host is a network namespace ``<prefix>-h<i>`` with its own hostname ``h<i>``, an
``eth0`` at ``10.77.0.<i>/24``, a loopback, and an sshd listening on ``eth0`` with a host
key and an authorized key made for this run. The ``eth0`` links meet on a bridge inside a
"switch" namespace ``<prefix>-sw``. Each link is shaped in both directions to ``--rate``
(``tbf``) with a one-way ``--delay`` (``netem``, where the kernel has it), so a host's
ranks share its link the way a node's GPUs share its NIC. Ranks on one host reach each
other over that host's loopback, unshaped.

The command runs as a real multi-host job: ``horovodrun -np H*S -H h1:S,...,hH:S`` started
on ``h1`` over ssh (Gloo by default, ``--mpi`` for Open MPI), with ``--network-interface
eth0``. Environment variables set for cluster.py reach every rank (Horovod exports them),
e.g. ``HOROVOD_HIERARCHICAL_ALLREDUCE=1``. ssh goes through a wrapper in ``PATH`` that
uses the run's key and no known-hosts file: nothing is written under ``~/.ssh``.

Nothing is created in the root namespace: the bridge, links and sshds live in the
namespaces, name resolution comes from ``/etc/netns/<ns>/hosts`` (``ip netns exec`` binds
it over ``/etc/hosts``), and the keys in a private temporary directory. All of it is
removed when the command ends, on error, on Ctrl-C and on SIGTERM. cluster.py refuses to
start where state with its prefix is left over (``--cleanup`` removes it).

Exit status: the command's (horovodrun's); 2 for bad usage or a refused start.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUBNET = "10.77.0"
#: the tools a cluster needs, and the Debian package of each (scripts/install.sh installs them)
TOOLS = {"ip": "iproute2", "tc": "iproute2", "unshare": "util-linux", "ssh": "openssh-client",
         "ssh-keygen": "openssh-client", "sshd": "openssh-server"}
SSHD_PATHS = ("/usr/sbin/sshd", "/usr/local/sbin/sshd")


class ClusterError(RuntimeError):
    """A cluster that cannot be started (the message says why and what to do)."""


def sh(*cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise ClusterError(f"`{shlex.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r


def shape(prefix: list, dev: str, rate: str, delay: str) -> tuple[str, bool]:
    """Shapes ``dev`` (inside the namespace that ``prefix`` enters) to ``rate`` with ``tbf``,
    after a ``netem`` one-way ``delay`` where the kernel has netem. Returns the resulting
    ``tc qdisc show`` and whether the delay was applied. Shared with bench_e2e.py."""
    tc = prefix + ["tc", "qdisc", "add", "dev", dev]
    tbf = ["tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
    delayed = False
    if delay not in ("", "0", "0us", "0ms"):
        if sh(*tc, "root", "handle", "1:", "netem", "delay", delay, check=False).returncode == 0:
            sh(*tc, "parent", "1:", "handle", "2:", *tbf)
            delayed = True
    if not delayed:
        sh(*tc, "root", *tbf)
    return sh(*prefix, "tc", "qdisc", "show", "dev", dev).stdout.strip(), delayed


#: a TCP probe, run as ``server ADDR PORT`` in one namespace and ``client ADDR PORT`` in
#: another: the client prints the throughput of a 64 MiB transfer (Gbit/s) and the median
#: round trip of a 1-byte ping-pong (us)
LINK_PROBE = r"""
import socket, statistics, sys, time
role, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
N = 64 << 20
if role == "server":
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, port)); srv.listen(1); print("ready", flush=True)
    c, _ = srv.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        b = c.recv(1 << 20)
        if not b: break
        if b == b"p": c.sendall(b"q")
    c.close()
else:
    s = socket.create_connection((addr, port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtt = []
    for _ in range(50):
        t = time.perf_counter(); s.sendall(b"p"); s.recv(1); rtt.append(time.perf_counter() - t)
    buf = b"\0" * (1 << 20)
    t = time.perf_counter()
    for _ in range(N >> 20): s.sendall(buf)
    s.shutdown(socket.SHUT_WR); s.recv(1)
    print(8 * N / (time.perf_counter() - t) / 1e9, statistics.median(rtt) * 1e6)
"""


def measure_link(server: list, client: list, addr: str, port: int = 5999) -> dict:
    """TCP throughput and round trip from the namespace ``client`` enters to ``addr`` in
    the one ``server`` enters (the same prefix twice, with 127.0.0.1, measures a loopback)."""
    srv = subprocess.Popen(server + [sys.executable, "-c", LINK_PROBE, "server", addr, str(port)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if srv.stdout.readline().strip() != "ready":
            raise ClusterError(f"link probe server failed: {srv.stderr.read()}")
        out = subprocess.run(client + [sys.executable, "-c", LINK_PROBE, "client", addr, str(port)],
                             check=True, capture_output=True, text=True, timeout=120).stdout.split()
    finally:
        srv.kill()
        srv.wait()
    return {"tcp_gbit_s": float(out[0]), "rtt_us": float(out[1])}


def sshd_binary() -> str | None:
    return next((p for p in SSHD_PATHS if os.access(p, os.X_OK)), shutil.which("sshd"))


#: Open MPI refuses to run as root unless told twice (CI and cluster.py run as root)
MPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def horovodrun_binary() -> str:
    """The horovodrun beside this interpreter (the venv's), else the one on PATH."""
    here = Path(sys.executable).with_name("horovodrun")
    found = str(here) if here.exists() else shutil.which("horovodrun")
    if not found:
        raise ClusterError("horovodrun not found: run with the venv's python (.venv/bin/python)")
    return found


def leftovers(prefix: str) -> list[str]:
    """Namespaces and /etc/netns entries named with ``prefix`` (what a killed run leaves)."""
    names = [line.split()[0] for line in sh("ip", "netns", "list", check=False).stdout.splitlines()
             if line.strip()]
    found = [f"namespace {n}" for n in names if n.startswith(prefix + "-")]
    etc = Path("/etc/netns")
    if etc.is_dir():
        found += [f"{p}" for p in sorted(etc.iterdir()) if p.name.startswith(prefix + "-")]
    return found


def cleanup(prefix: str) -> list[str]:
    """Removes every namespace (and the processes in it) and /etc/netns entry of ``prefix``."""
    removed = []
    for item in leftovers(prefix):
        if item.startswith("namespace "):
            ns = item.split()[1]
            _kill_namespace(ns)
            sh("ip", "netns", "del", ns, check=False)
        else:
            shutil.rmtree(item, ignore_errors=True)
        removed.append(item)
    return removed


def _kill_namespace(ns: str) -> None:
    """SIGTERM, then SIGKILL, every process in namespace ``ns``."""
    for sig, pause in ((signal.SIGTERM, 0.5), (signal.SIGKILL, 0.0)):
        pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), sig)
            except (ProcessLookupError, ValueError):
                pass
        if not pids:
            return
        time.sleep(pause)


class Cluster:
    """``hosts`` namespaces with ``slots`` slots each, shaped links and an sshd each.

    A context manager: ``__enter__`` builds everything (or removes what it built and
    raises), ``__exit__`` removes everything, whatever the exit. ``command()`` gives the
    argv that launches a job on it."""

    def __init__(self, hosts: int = 2, slots: int = 2, rate: str = "1gbit",
                 delay: str = "100us", prefix: str = "ssfc"):
        if not 1 <= hosts <= 200:
            raise ClusterError(f"--hosts must be in 1..200, got {hosts}")
        if slots < 1:
            raise ClusterError(f"--slots must be >= 1, got {slots}")
        if not prefix.replace("_", "").isalnum() or len(prefix) > 8:
            raise ClusterError(f"--prefix must be up to 8 letters or digits, got {prefix!r}")
        self.hosts, self.slots, self.rate, self.delay, self.prefix = hosts, slots, rate, delay, prefix
        self.names = [f"h{i}" for i in range(1, hosts + 1)]
        self.addrs = [f"{SUBNET}.{i}" for i in range(1, hosts + 1)]
        self.switch = f"{prefix}-sw"
        self.shaping: dict = {}
        self.delay_applied = False
        self.state: Path | None = None
        self._created: list[str] = []  # namespaces, in creation order
        self._sshd: list[subprocess.Popen] = []
        self._made_run_sshd = False

    # ------------------------------------------------------------ names
    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def enter(self, host: str, hostname: bool = True) -> list[str]:
        """argv prefix that runs a command on ``host`` (its namespace, /etc/hosts, hostname)."""
        pre = ["ip", "netns", "exec", self.ns(host)]
        if hostname:
            pre += ["unshare", "--uts", "--", "sh", "-c", f'hostname {host} && exec "$@"', "sh"]
        return pre

    @property
    def host_list(self) -> str:
        return ",".join(f"{h}:{self.slots}" for h in self.names)

    # ------------------------------------------------------------ build
    def __enter__(self) -> "Cluster":
        self._preflight()
        try:
            self._build()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _preflight(self) -> None:
        self.requirements(self.prefix)
        left = leftovers(self.prefix)
        if left:
            raise ClusterError(
                f"state named '{self.prefix}-*' already exists ({', '.join(left)}): another "
                f"cluster is running, or one was killed before it cleaned up. cluster.py does not "
                f"touch state it did not create; remove it with `{sys.executable} "
                f"{Path(__file__).resolve()} --cleanup --prefix {self.prefix}` if nothing uses it")

    @staticmethod
    def requirements(prefix: str = "ssfc") -> None:
        """Raises ClusterError unless this machine can run a cluster (root, the tools, and
        network namespaces: a probe one, named with ``prefix``, is made and removed)."""
        if os.geteuid() != 0:
            raise ClusterError("cluster.py needs root (network namespaces, tc, sshd): run it with sudo")
        missing = sorted({pkg for tool, pkg in TOOLS.items()
                          if not (sshd_binary() if tool == "sshd" else shutil.which(tool))})
        if missing:
            raise ClusterError(f"cluster.py needs the Debian packages {', '.join(missing)} "
                               "(scripts/install.sh installs them when run as root)")
        probe = f"{prefix}-probe{os.getpid()}"  # root is not always enough (a container)
        try:
            made = sh("ip", "netns", "add", probe, check=False)
        finally:
            sh("ip", "netns", "del", probe, check=False)
        if made.returncode != 0:
            raise ClusterError(f"cannot create network namespaces here: {made.stderr.strip()}")

    def _build(self) -> None:
        self.state = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-cluster-"))
        key = self.state / "id_ed25519"
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ssfusion-cluster", "-f", str(key))
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.state / "host_key"))
        shutil.copy(f"{key}.pub", self.state / "authorized_keys")
        self._write_ssh_wrapper(key)
        if not Path("/run/sshd").is_dir():  # sshd's privilege-separation directory
            os.makedirs("/run/sshd", mode=0o755)
            self._made_run_sshd = True

        self._add_namespace(self.switch)
        sh(*self.enter_raw(self.switch), "ip", "link", "add", "br0", "type", "bridge")
        sh(*self.enter_raw(self.switch), "ip", "link", "set", "br0", "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{a} {h}\n" for a, h in zip(self.addrs, self.names))
        for i, (host, addr) in enumerate(zip(self.names, self.addrs), start=1):
            ns = self.ns(host)
            self._add_namespace(ns)
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
            (etc / "hostname").write_text(host + "\n")
            port = f"p{i}"
            sh(*self.enter_raw(self.switch), "ip", "link", "add", port, "type", "veth",
               "peer", "name", "eth0", "netns", ns)
            sh(*self.enter_raw(self.switch), "ip", "link", "set", port, "master", "br0", "up")
            sh(*self.enter_raw(ns), "ip", "addr", "add", f"{addr}/24", "dev", "eth0")
            sh(*self.enter_raw(ns), "ip", "link", "set", "eth0", "up")
            sh(*self.enter_raw(ns), "ip", "link", "set", "lo", "up")
            # uplink (host -> switch) carries the delay; downlink the rate only, so a
            # host-to-host packet is delayed once and rate-limited at both ends
            up, self.delay_applied = shape(self.enter_raw(ns), "eth0", self.rate, self.delay)
            down, _ = shape(self.enter_raw(self.switch), port, self.rate, "0")
            self.shaping[host] = {"uplink": up, "downlink": down}
            self._start_sshd(host, addr)
        for host in self.names:
            self._wait_ssh(host)

    def enter_raw(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def _add_namespace(self, ns: str) -> None:
        sh("ip", "netns", "add", ns)
        self._created.append(ns)

    def _write_ssh_wrapper(self, key: Path) -> None:
        bin_dir = self.state / "bin"
        bin_dir.mkdir()
        wrapper = bin_dir / "ssh"
        opts = ["-F", "/dev/null", "-i", str(key), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=no",
                "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=10"]
        wrapper.write_text("#!/bin/sh\n# ssh with this cluster run's key; nothing written to ~/.ssh\n"
                           f"exec {shutil.which('ssh')} {shlex.join(opts)} \"$@\"\n")
        wrapper.chmod(0o755)
        self.ssh = str(wrapper)

    def _start_sshd(self, host: str, addr: str) -> None:
        cfg = self.state / f"sshd_{host}.conf"
        cfg.write_text("\n".join([
            f"ListenAddress {addr}", "Port 22", f"HostKey {self.state / 'host_key'}",
            f"AuthorizedKeysFile {self.state / 'authorized_keys'}", "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "UsePAM no", "StrictModes no", "X11Forwarding no", "PrintMotd no", "LogLevel ERROR",
            f"PidFile {self.state / f'sshd_{host}.pid'}", "MaxStartups 100:30:200", "MaxSessions 100",
            ""]))
        log = open(self.state / f"sshd_{host}.log", "w")
        self._sshd.append(subprocess.Popen(
            self.enter(host) + [sshd_binary(), "-D", "-e", "-f", str(cfg)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log.close()

    def _wait_ssh(self, host: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            r = sh(*self.enter(self.names[0]), self.ssh, host, "hostname", check=False, timeout=30)
            if r.returncode == 0 and r.stdout.strip() == host:
                return
            if time.monotonic() > deadline:
                log = (self.state / f"sshd_{host}.log").read_text()[-2000:]
                raise ClusterError(f"sshd on {host} did not answer within {timeout:.0f}s: "
                                   f"{r.stderr.strip()} {r.stdout.strip()}\nsshd log:\n{log}")
            time.sleep(0.2)

    # ------------------------------------------------------------ run
    def command(self, argv: list[str], controller: str = "gloo", np: int | None = None,
                env: dict | None = None, horovodrun_args: list[str] = ()) -> list[str]:
        """argv that runs ``horovodrun -np N -H h1:S,... --gloo|--mpi <argv>`` from ``h1``."""
        if controller not in ("gloo", "mpi"):
            raise ClusterError(f"controller must be 'gloo' or 'mpi', got {controller!r}")
        np = self.hosts * self.slots if np is None else np
        run_env = {"PATH": f"{self.state / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        if controller == "mpi":
            run_env.update(MPI_AS_ROOT,
                           # every orted is started from h1 with the run's key (no tree spawn
                           # through hosts whose PATH lacks the wrapper)
                           OMPI_MCA_plm_rsh_agent=self.ssh, OMPI_MCA_plm_rsh_no_tree_spawn="1",
                           OMPI_MCA_oob_tcp_if_include="eth0")
        run_env.update(env or {})
        return (self.enter(self.names[0]) + ["env"] + [f"{k}={v}" for k, v in run_env.items()]
                + [horovodrun_binary(), "-np", str(np), "-H", self.host_list, f"--{controller}",
                   "--network-interface", "eth0", *horovodrun_args] + list(argv))

    def measure_link(self) -> dict:
        """TCP between the first two hosts (h1 -> h2 crosses both shaped links)."""
        if self.hosts < 2:
            return measure_link(self.enter_raw(self.ns("h1")), self.enter_raw(self.ns("h1")), "127.0.0.1")
        return measure_link(self.enter_raw(self.ns("h2")), self.enter_raw(self.ns("h1")), self.addrs[1])

    def describe(self) -> str:
        return (f"{self.hosts} hosts x {self.slots} slots ({self.host_list}); each link "
                f"{self.rate} each way, one-way delay "
                f"{self.delay if self.delay_applied else '0 (no netem)'}; bridge in {self.switch}")

    # ------------------------------------------------------------ teardown
    def __exit__(self, *exc) -> None:
        for ns in reversed(self._created):
            _kill_namespace(ns)
        for p in self._sshd:
            if p.poll() is None:
                p.kill()
            p.wait()
        for ns in reversed(self._created):  # the switch goes last, with the bridge and ports
            sh("ip", "netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        self._created = []
        if self.state is not None:
            shutil.rmtree(self.state, ignore_errors=True)
            self.state = None
        if self._made_run_sshd:
            try:
                os.rmdir("/run/sshd")
            except OSError:
                pass
            self._made_run_sshd = False


def _raise_on_signal(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run(cluster: Cluster, cmd: list[str], timeout: float | None = None, **kwargs) -> int:
    """Runs a job on a started cluster in its own process group; on timeout or interrupt
    the whole group is killed. Returns horovodrun's exit status (124 on timeout)."""
    proc = subprocess.Popen(cluster.command(cmd, **kwargs), start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"[cluster] the job ran past {timeout:.0f}s; killed", file=sys.stderr, flush=True)
        return 124
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--slots", type=int, default=2, help="ranks per host")
    p.add_argument("--rate", default="1gbit", help="tc rate of each host's link, each way")
    p.add_argument("--delay", default="100us", help="one-way host-to-host delay (netem); 0 for none")
    p.add_argument("--mpi", action="store_true", help="Open MPI controller (default: Gloo)")
    p.add_argument("--timeout", type=float, default=None, help="seconds before the job is killed")
    p.add_argument("--prefix", default="ssfc", help="name prefix of the namespaces")
    p.add_argument("--cleanup", action="store_true", help="remove state left by a killed run, then exit")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command every rank runs")
    args = p.parse_args(argv)
    if args.cmd[:1] == ["--"]:
        args.cmd = args.cmd[1:]
    if not args.cleanup and not args.cmd:
        p.error("give the command after --, e.g. -- python train.py")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # explicit for SIGINT too: a job started in the background inherits an ignored SIGINT
    signal.signal(signal.SIGTERM, _raise_on_signal)
    signal.signal(signal.SIGINT, _raise_on_signal)
    try:
        if args.cleanup:
            if os.geteuid() != 0:
                raise ClusterError("--cleanup needs root")
            removed = cleanup(args.prefix)
            print(f"[cluster] removed: {', '.join(removed) or 'nothing'}")
            return 0
        with Cluster(args.hosts, args.slots, args.rate, args.delay, args.prefix) as c:
            print(f"[cluster] {c.describe()}", flush=True)
            rc = run(c, args.cmd, timeout=args.timeout, controller="mpi" if args.mpi else "gloo")
        print(f"[cluster] job exited {rc}; cluster removed", flush=True)
        return rc
    except ClusterError as e:
        print(f"[cluster] {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt as e:
        print(f"[cluster] interrupted ({e}); cluster removed", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
