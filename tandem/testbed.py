"""A test bed of hosts on this machine (issue 17): each host is a network namespace with its own
address on a private bridge the bed creates, loopback up, and an sshd listening on that address
only, reached with a key pair made for the bed. ``ray up`` and the node-level faults run on it.

Layout (``SUBNET`` = 10.213.0.0/24 unless given): bridge ``tdm-br0`` in the root namespace at
``.254``; host ``i`` is namespace ``tdm-h<i>`` with ``eth0`` at ``.<i + 1>``, joined to the
bridge by the veth ``tdm-h<i>-v``. The hosts have no default route: they reach each other and
the root namespace's bridge address, nothing else. State (keys, sshd configs and pid files,
``bed.json``) lives in ``tandem_home()/testbed``. :func:`down` removes everything by name, so it
also cleans up after a run that crashed half-way. Needs root (CAP_NET_ADMIN), iproute2 and
OpenSSH's server; :class:`TestbedUnavailable` says which is missing.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from contracts.roles import NAMESPACE, ROUTER_NAME
from tandem.demo import tandem_home

CHECKOUT = Path(__file__).resolve().parents[1]
# `ray up`'s file for the 3-host bed of domains a, b, c: what cluster_config() writes for it.
CLUSTER_FILE = CHECKOUT / "deploy" / "cluster-testbed.yaml"
PREFIX = "tdm"
BRIDGE = f"{PREFIX}-br0"
SUBNET = "10.213.0.0/24"
SSH_PORT = 22
# deploy/cluster-testbed.yaml's cluster_name, in Ray's local-provider state file.
RAY_LOCAL_STATE = "/tmp/ray/cluster-tandem-testbed.state"
READY_TIMEOUT_S = 20.0
CLONE_NEWNET = 0x40000000  # setns(2)'s namespace type (os.CLONE_NEWNET from Python 3.12)


class RemoteCommandFailed(RuntimeError):
    """A command run on a bed host over SSH exited non-zero: the host, its exit status and the
    end of its output (a bare CalledProcessError names the command line, not why it failed)."""


class TestbedUnavailable(RuntimeError):
    """This machine cannot run the test bed (not root, no iproute2, sshd or rsync): the reason.
    ``installable``: what is missing is a package this root with apt could install (setup
    does), so its absence is a broken setup, not an impossible bed."""

    __test__ = False  # not a pytest test class, whatever its name

    def __init__(self, why: str, installable: bool = False) -> None:
        super().__init__(why)
        self.installable = installable


@dataclass(frozen=True)
class Host:
    name: str  # the network namespace
    address: str  # eth0's address, sshd's only listening address
    domain: str  # the failure domain its Ray node will be labelled with


@dataclass(frozen=True)
class Testbed:
    __test__ = False  # not a pytest test class, whatever its name

    hosts: list[Host]
    bridge_address: str  # the root namespace's address on the bed
    key: Path  # the bed's private key (user root)
    state_dir: Path

    @property
    def cluster_file(self) -> Path:
        """``ray up``'s file for this bed (written by :func:`up`: :func:`cluster_config`)."""
        return self.state_dir / "cluster.yaml"

    def ssh_args(self, host: Host) -> list[str]:
        """The ``ssh`` command line that runs a command on ``host`` (append the command)."""
        return [
            "ssh",
            "-i",
            str(self.key),
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
            f"root@{host.address}",
        ]

    def ssh(self, host: Host, command: str, timeout_s: float = 30.0) -> str:
        """Run ``command`` on ``host`` over SSH; its stdout. Raises :class:`RemoteCommandFailed`."""
        out = subprocess.run(
            [*self.ssh_args(host), command],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if out.returncode != 0:
            tail = (out.stdout[-1500:] + "\n" + out.stderr[-2500:]).strip()
            raise RemoteCommandFailed(
                f"on {host.name} ({host.address}), exit {out.returncode}: {command[:200]}\n{tail}"
            )
        return out.stdout


def default_state_dir() -> Path:
    return tandem_home() / "testbed"


# What to do about a missing tool (scripts/setup.sh installs both where it runs as root with apt).
INSTALL_HINT = "install {} (as root: `apt-get install openssh-server rsync`, or `make setup`)"


def _apt() -> bool:
    return shutil.which("apt-get") is not None


def check_possible() -> None:
    """Raise :class:`TestbedUnavailable` unless namespaces, links and sshd can be made here."""
    if os.geteuid() != 0:
        raise TestbedUnavailable(
            "the test bed needs root (CAP_NET_ADMIN) to create network namespaces and links"
        )
    for tool, package in (
        ("ip", "iproute2"),
        ("ssh", "openssh-client"),
        ("ssh-keygen", "openssh-client"),
        ("rsync", "rsync"),  # `ray up` copies the cluster's files to each host with it
    ):
        if shutil.which(tool) is None:
            raise TestbedUnavailable(
                f"`{tool}` not found: {INSTALL_HINT.format(package)}", installable=_apt()
            )
    if not Path(_sshd()).exists():
        raise TestbedUnavailable(
            f"{_sshd()} not found: {INSTALL_HINT.format('openssh-server')}", installable=_apt()
        )
    probe = f"{PREFIX}-probe"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as exc:
        raise TestbedUnavailable(
            f"cannot create a network namespace: {exc.stderr.strip()}"
        ) from exc
    _ip("netns", "del", probe)


def up(
    nodes: int,
    domains: list[str] | None = None,
    subnet: str = SUBNET,
    state_dir: Path | None = None,
) -> Testbed:
    """Start (or keep, when the running bed is this one and alive) ``nodes`` hosts; host ``i``
    is in domain ``domains[i % len(domains)]`` (default: its own, ``h<i>``)."""
    if nodes < 1:
        raise ValueError(f"nodes={nodes}: a bed needs at least one host")
    state_dir = state_dir or default_state_dir()
    net = ipaddress.ip_network(subnet)
    if net.num_addresses - 3 < nodes:  # network, broadcast and the bridge's own address
        raise ValueError(f"subnet {subnet} has no room for {nodes} hosts")
    names = domains or [f"h{i}" for i in range(nodes)]
    hosts = [
        Host(f"{PREFIX}-h{i}", str(net.network_address + i + 1), names[i % len(names)])
        for i in range(nodes)
    ]
    bridge_address = str(net.broadcast_address - 1)
    bed = Testbed(hosts, bridge_address, state_dir / "id_ed25519", state_dir)
    running = load(state_dir)
    if running is not None and running.hosts == hosts and _alive(running):
        return running
    check_possible()
    down(state_dir)
    state_dir.mkdir(parents=True)
    _keys(state_dir)
    prefix = net.prefixlen
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "add", f"{bridge_address}/{prefix}", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    for host in hosts:
        veth = f"{host.name}-v"
        _ip("netns", "add", host.name)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", host.name)
        _ip("link", "set", veth, "master", BRIDGE, "up")
        _ip("-n", host.name, "link", "set", "lo", "up")
        _ip("-n", host.name, "addr", "add", f"{host.address}/{prefix}", "dev", "eth0")
        _ip("-n", host.name, "link", "set", "eth0", "up")
        _start_sshd(host, _sshd_config(state_dir, host))
    (state_dir / "bed.json").write_text(json.dumps(to_json(bed), indent=2))
    bed.cluster_file.write_text(CLUSTER_HEADER.format(n=nodes) + yaml_dump(cluster_config(bed)))
    # The checkout whose .venv the bed's hosts run (deploy/cluster-testbed.yaml reads it).
    (state_dir / "checkout").write_text(str(CHECKOUT))
    _wait_ready(bed)
    return bed


def down(state_dir: Path | None = None) -> None:
    """Remove every host, link and process of the bed, and its state -- found by name, so a bed
    a crashed run left half-made goes too. Nothing to remove is not an error."""
    state_dir = state_dir or default_state_dir()
    for ns in namespaces():
        for pid in _ip("netns", "pids", ns).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "del", ns)
    for link in links():
        try:
            _ip("link", "del", link)
        except subprocess.CalledProcessError:
            pass  # a veth went with its peer's namespace
    shutil.rmtree(state_dir, ignore_errors=True)
    # Ray's local provider keeps its view of the bed's nodes here; the next `ray up` must not
    # take the hosts of a bed that is gone for running or terminated.
    Path(RAY_LOCAL_STATE).unlink(missing_ok=True)


# -- node-level faults (the chaos harness builds on them) ----------------------------------------


def kill_host(host: Host) -> list[int]:
    """Every process of ``host`` SIGKILLed at once, as when a machine dies (its sshd too): its
    PID namespace's init, which takes the rest with it, and anything else in its network
    namespace. Returns the (root-namespace) pids that were there. The namespace and its
    address stay: :func:`revive_host`."""
    pids = [int(p) for p in _ip("netns", "pids", host.name).split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def revive_host(bed: Testbed, host: Host) -> None:
    """Start ``host``'s sshd again after :func:`kill_host` (a rebooted machine)."""
    _start_sshd(host, bed.state_dir / f"sshd-{host.name}.conf")
    _wait_ready(Testbed([host], bed.bridge_address, bed.key, bed.state_dir))


RAY_START_TRIES = 3


def restart_ray_node(bed: Testbed, host: Host) -> None:
    """Start ``host``'s Ray node again (after :func:`revive_host`, or to replace a node Ray
    declared dead) with the start commands of the ``ray up`` file that launched the bed's
    cluster: the head's if ``host`` is its ``head_ip``, else the workers'."""
    import yaml

    config = yaml.safe_load(bed.cluster_file.read_text())
    head = config["provider"]["head_ip"]
    key = "head_start_ray_commands" if host.address == head else "worker_start_ray_commands"
    commands = " && ".join(f"( {c} )" for c in config[key])
    for attempt in range(RAY_START_TRIES):
        try:
            bed.ssh(host, f"export RAY_HEAD_IP={head} && {commands}", timeout_s=120.0)
            return
        except RemoteCommandFailed:  # `ray start` can time out reaching a busy head: again
            if attempt == RAY_START_TRIES - 1:
                raise
            time.sleep(5.0)


def enter(host: Host) -> None:
    """Move this process into ``host``'s network namespace: its sockets from now on have the
    host's addresses and links. For a child process, first thing (``setns`` moves the calling
    thread; threads started later follow it). Needs root."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{host.name}") as ns:
        if libc.setns(ns.fileno(), CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {host.name}: {os.strerror(errno)}")


# -- Tandem on the bed (deploy/cluster-testbed.yaml launched: the head is host 0) ----------------

RAY_PORT = 6379  # the head's GCS port in deploy/cluster-testbed.yaml
SERVE_PORT = 8000
REPLY = "tandem-testbed-reply: "  # on_head's marker for its driver's answer


def ray_up(cluster_file: Path) -> None:
    """``ray up`` a bed's cluster file (``Testbed.cluster_file``), as a user launches it;
    RuntimeError with the end of Ray's output if it fails (a missing rsync, an sshd that does
    not answer)."""
    out = subprocess.run(
        [str(Path(sys.executable).with_name("ray")), "up", "-y", "--no-config-cache"]
        + [str(cluster_file)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"ray up {cluster_file.name} failed: {(out.stdout + out.stderr)[-3000:]}"
        )


def ray_down(cluster_file: Path, check: bool = False) -> None:
    """``ray down`` a bed's cluster; with ``check``, RuntimeError if it fails (else best
    effort: whatever is left of a cluster whose hosts were killed)."""
    ray = str(Path(sys.executable).with_name("ray"))
    out = subprocess.run(
        [ray, "down", "-y", str(cluster_file)], capture_output=True, text=True, timeout=120
    )
    if check and out.returncode != 0:
        raise RuntimeError(f"ray down failed: {(out.stdout + out.stderr)[-3000:]}")


# -- the bed's `ray up` file ---------------------------------------------------------------------

NODE_MEMORY = 4 * 2**30  # what each host's Ray node offers (the hosts share this machine's)
NODE_OBJECT_STORE = 256 * 2**20
CLUSTER_HEADER = """\
# `ray up` for the {n}-host test bed `tandem testbed up` made (written by tandem/testbed.py;
# deploy/cluster-testbed.yaml explains each part, for the 3-host bed of domains a, b, c).
"""


def cluster_config(bed: Testbed) -> dict[str, Any]:
    """``ray up``'s cluster file for ``bed``: the head on host 0, a worker on each other host,
    each Ray node labelled with its host's failure domain (a worker finds its own by its
    address). For the 3-host bed of domains a, b, c this is deploy/cluster-testbed.yaml."""
    head, *workers = bed.hosts
    home = str(Path.home())
    state = (
        str(bed.state_dir).replace(home, "~", 1)
        if str(bed.state_dir).startswith(home)
        else str(bed.state_dir)
    )
    cd = f'cd "$(cat {state}/checkout)"'
    env = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 RAY_USAGE_STATS_ENABLED=0"
    sizes = f"--memory={NODE_MEMORY} --object-store-memory={NODE_OBJECT_STORE}"
    label = "--labels=tandem/failure-domain="
    arms = " ".join(f'*" {w.address} "*) host={w.name}; domain={w.domain} ;;' for w in workers)
    return {
        "cluster_name": "tandem-testbed",
        "metadata": {"tandem": {"topology": "deploy/topologies/testbed.yaml"}},
        "provider": {
            "type": "local",
            "head_ip": head.address,
            "worker_ips": [w.address for w in workers],
        },
        "auth": {"ssh_user": "root", "ssh_private_key": f"{state}/{bed.key.name}"},
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 5,
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [
            f"{cd} && ray stop",
            f"{cd} && {env} RAY_enable_autoscaler_v2=0 ray start --head --port={RAY_PORT} "
            f"--node-ip-address={head.address} --autoscaling-config=~/ray_bootstrap_config.yaml "
            f"--temp-dir=/tmp/ray-{head.name} {sizes} {label}{head.domain}",
        ],
        "worker_start_ray_commands": [
            f"{cd} && ray stop",
            f'case " $(hostname -I) " in {arms} *) echo "cluster file: not a bed host '
            f'($(hostname -I))" >&2; exit 1 ;; esac; {cd} && addr=$(hostname -I); '
            f"addr=${{addr%% *}}; {env} ray start --address=$RAY_HEAD_IP:{RAY_PORT} "
            f"--node-ip-address=$addr --temp-dir=/tmp/ray-$host {sizes} {label}$domain",
        ],
    }


def yaml_dump(config: dict[str, Any]) -> str:
    import yaml

    return str(yaml.safe_dump(config, sort_keys=False, width=100))


def url(bed: Testbed) -> str:
    """Where ``serve_on_head`` answers HTTP (reached from this machine's own namespace)."""
    return f"http://{bed.hosts[0].address}:{SERVE_PORT}"


def on_head(bed: Testbed, code: str, timeout_s: float = 120.0) -> Any:
    """Run ``code`` in a Ray driver on the head host (after ``ray.init`` of the bed's cluster;
    ``json`` and ``ray`` imported); what it passes to ``reply(obj)`` (JSON-able). RuntimeError
    with its stderr if it fails. (Ray itself may print to stdout, e.g. about a dead node.)"""
    head = bed.hosts[0]
    script = (
        "import json, ray\n"
        f"def reply(obj): print({REPLY!r} + json.dumps(obj), flush=True)\n"
        f"ray.init(address='{head.address}:{RAY_PORT}', logging_level='ERROR', "
        "log_to_driver=False)\n" + code
    )
    env = {"PATH": "/usr/bin:/bin", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
    out = subprocess.run(
        ["ip", "netns", "exec", head.name, sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        cwd=CHECKOUT,
        timeout=timeout_s,
    )
    if out.returncode != 0:
        raise RuntimeError(f"driver on {head.name} failed: {out.stderr[-3000:]}")
    replies = [line for line in out.stdout.splitlines() if line.startswith(REPLY)]
    if not replies:
        raise RuntimeError(f"driver on {head.name} did not reply: {out.stdout[-3000:]}")
    return json.loads(replies[-1].removeprefix(REPLY))


def ask_router(bed: Testbed, method: str) -> Any:
    """The answer of the Tandem router actor's ``method`` (no arguments, JSON-able), e.g.
    ``decisions`` or ``health_events``, asked by a driver on the head host."""
    code = f"r = ray.get_actor({ROUTER_NAME!r}, namespace={NAMESPACE!r})\n"
    code += f"reply(ray.get(r.{method}.remote(), timeout=30))\n"
    return on_head(bed, code)


def serve_on_head(bed: Testbed, topology: Path) -> subprocess.Popen[bytes]:
    """``tandem serve --address`` on the head host, over SSH, as a user of ``ray up`` runs it
    (output to ``serve.log`` in the bed's state dir); returns once ``/health`` answers 200."""
    from tandem.serve import wait_until_ready

    head = bed.hosts[0].address
    log = open(bed.state_dir / "serve.log", "ab")  # noqa: SIM115  (the child keeps it)
    command = (
        f"cd {CHECKOUT} && exec .venv/bin/tandem serve --address {head}:{RAY_PORT} "
        f"--host {head} --port {SERVE_PORT} --topology {topology}"
    )
    proc = subprocess.Popen([*bed.ssh_args(bed.hosts[0]), command], stdout=log, stderr=log)
    log.close()
    wait_until_ready(url(bed), timeout_s=300)
    return proc


def stop_serving(bed: Testbed, proc: subprocess.Popen[bytes]) -> None:
    """Ctrl-C for :func:`serve_on_head`'s ``tandem serve``: it removes its application and
    its cluster's actors."""
    bed.ssh(bed.hosts[0], "pkill -INT -f 'tandem serve' || true")
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()


def partition(host: Host) -> None:
    """Cut ``host`` off the bed, both directions (its link to the bridge down); its processes
    keep running and time out, as behind a failed switch port."""
    _ip("link", "set", f"{host.name}-v", "down")


def heal(host: Host) -> None:
    """Undo :func:`partition`."""
    _ip("link", "set", f"{host.name}-v", "up")


def namespaces() -> list[str]:
    """The bed's network namespaces that exist now."""
    out = _ip("netns", "list")
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{PREFIX}-")]


def links() -> list[str]:
    """The bed's links in the root namespace that exist now."""
    out = _ip("-o", "link", "show")
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]
    return [n for n in names if n.startswith(f"{PREFIX}-")]


def load(state_dir: Path | None = None) -> Testbed | None:
    """The bed recorded in ``state_dir``, or None."""
    path = (state_dir or default_state_dir()) / "bed.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return Testbed(
        [Host(**h) for h in data["hosts"]],
        data["bridge_address"],
        Path(data["key"]),
        Path(data["state_dir"]),
    )


def to_json(bed: Testbed) -> dict[str, object]:
    """What ``bed.json`` (and ``tandem testbed up``) records of a bed."""
    return {
        "hosts": [asdict(h) for h in bed.hosts],
        "bridge_address": bed.bridge_address,
        "key": str(bed.key),
        "state_dir": str(bed.state_dir),
    }


def _alive(bed: Testbed) -> bool:
    """Every host's namespace exists and its sshd answers."""
    present = set(namespaces())
    return all(h.name in present for h in bed.hosts) and all(_answers(h) for h in bed.hosts)


def _answers(host: Host, timeout_s: float = 1.0) -> bool:
    try:
        with socket.create_connection((host.address, SSH_PORT), timeout=timeout_s) as conn:
            return conn.recv(4).startswith(b"SSH-")
    except OSError:
        return False


def _wait_ready(bed: Testbed) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    for host in bed.hosts:
        while not _answers(host):
            if time.monotonic() > deadline:
                raise TestbedUnavailable(f"sshd on {host.name} ({host.address}) did not answer")
            time.sleep(0.05)


def _keys(state_dir: Path) -> None:
    """The bed's client key pair and one host key, made fresh for each bed."""
    for name in ("id_ed25519", "ssh_host_ed25519_key"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(state_dir / name)],
            check=True,
        )
    shutil.copy(state_dir / "id_ed25519.pub", state_dir / "authorized_keys")


def _sshd_config(state_dir: Path, host: Host) -> Path:
    path = state_dir / f"sshd-{host.name}.conf"
    path.write_text(
        f"ListenAddress {host.address}:{SSH_PORT}\n"
        f"HostKey {state_dir / 'ssh_host_ed25519_key'}\n"
        f"AuthorizedKeysFile {state_dir / 'authorized_keys'}\n"
        "PidFile none\n"
        "PermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "UsePAM no\n"
        "StrictModes no\n"
        "PrintMotd no\n"
    )
    return path


def _start_sshd(host: Host, config: Path) -> None:
    """The host's first process: in its network namespace, a PID and a mount namespace of its
    own (its own /proc) whose init is sshd in the foreground. What runs there (a Ray node) sees only
    the host's processes (``ray stop`` stops only its own), and when the init dies the kernel
    kills every process of the host at once. ``unshare --kill-child`` ties the init to the
    ``unshare`` process, whose pid (in the root namespace) goes to ``host-<name>.pid``."""
    log = open(config.with_suffix(".log"), "ab")  # noqa: SIM115  (the child keeps it)
    # In the host's own mount namespace, this checkout's .venv/bin over /usr/local/bin: its
    # `ray` and `tandem` are on every login shell's PATH there (ray up / ray down call `ray`).
    init = f"mount --bind {CHECKOUT / '.venv' / 'bin'} /usr/local/bin && exec {_sshd()} -D -e -f {config}"
    proc = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            host.name,
            "unshare",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            "sh",
            "-c",
            init,
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    log.close()
    (config.parent / f"host-{host.name}.pid").write_text(str(proc.pid))


def _sshd() -> str:
    return "/usr/sbin/sshd"


ROOT_NETNS_ENV = "TANDEM_BED_ROOT_NETNS"  # a process inside a host: where the bed's root is


def _ip(*args: str) -> str:
    """``ip`` in this machine's own network namespace (where the bridge and the hosts' link
    ends are), also from inside a host (a chaos run's driver on the head, given the path of
    the root namespace in ``TANDEM_BED_ROOT_NETNS``)."""
    root = os.environ.get(ROOT_NETNS_ENV)
    enter = ["nsenter", f"--net={root}"] if root else []
    out = subprocess.run([*enter, "ip", *args], check=True, capture_output=True, text=True)
    return out.stdout
