"""The test bed (issue 17, point 1): hosts in network namespaces on a private bridge, each with
its own address and an sshd on it; idempotent ``up``, complete ``down`` (after a crash too), and
a clear error where the machine does not allow it. Skipped, with the reason, where it cannot
run (not root, no sshd). The bed's names (``tdm-*``) are global: a bed left running is replaced."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import skip_unless_bed_possible

from tandem import testbed
from tandem.testbed import Host, Testbed, TestbedUnavailable

pytestmark = pytest.mark.e2e  # it starts sshd processes


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    skip_unless_bed_possible()
    yield tmp_path / "bed"
    testbed.down(tmp_path / "bed")


def live(pid: int) -> bool:
    """The process exists and is not a zombie (this sandbox's PID 1 does not reap killed
    daemons)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def host_pids(state_dir: Path) -> list[int]:
    """The root-namespace pids that hold each host's processes."""
    return sorted(int(p.read_text()) for p in state_dir.glob("host-*.pid"))


def test_up_makes_hosts_that_reach_each_other_and_nothing_else(state_dir: Path) -> None:
    bed = testbed.up(3, ["a", "b"], state_dir=state_dir)
    assert [(h.name, h.address, h.domain) for h in bed.hosts] == [
        ("tdm-h0", "10.213.0.1", "a"),
        ("tdm-h1", "10.213.0.2", "b"),
        ("tdm-h2", "10.213.0.3", "a"),
    ]
    for host in bed.hosts:
        # Its own address on eth0, and one route: the bed's subnet (no default route out).
        assert f"inet {host.address}/24" in bed.ssh(host, "ip -4 -o addr show eth0")
        routes = bed.ssh(host, "ip route").strip().splitlines()
        assert len(routes) == 1 and routes[0].startswith("10.213.0.0/24 dev eth0")
    # Host 0 reaches host 2's sshd over the bridge (a real link between namespaces).
    probe = "import socket; print(socket.create_connection(('10.213.0.3', 22), 2).recv(4))"
    out = subprocess.run(
        ["ip", "netns", "exec", "tdm-h0", "python3", "-c", probe],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "b'SSH-'"
    # Each host has its own processes: sshd is its init, the command's shell is in there.
    pids = bed.ssh(bed.hosts[0], "ls /proc | grep -E '^[0-9]+$'").split()
    assert "1" in pids and len(pids) < 10
    assert "sshd" in bed.ssh(bed.hosts[0], "cat /proc/1/cmdline | tr '\\0' ' '")
    # sshd listens on the host's address only.
    listening = bed.ssh(bed.hosts[1], "cat /proc/net/tcp")
    assert "0200D50A:0016" in listening  # 10.213.0.2:22, little-endian hex
    assert "00000000:0016" not in listening
    # A failed remote command says where and why (its output), not only its command line.
    with pytest.raises(
        testbed.RemoteCommandFailed, match=r"tdm-h1 \(10.213.0.2\), exit 3(.|\n)*boom"
    ):
        bed.ssh(bed.hosts[1], "echo boom >&2; exit 3")


def test_up_again_keeps_the_running_bed(state_dir: Path) -> None:
    bed = testbed.up(2, state_dir=state_dir)
    pids = host_pids(state_dir)
    again = testbed.up(2, state_dir=state_dir)
    assert again == bed
    assert host_pids(state_dir) == pids and all(live(pid) for pid in pids)
    # Another shape replaces it.
    bigger = testbed.up(3, state_dir=state_dir)
    assert len(bigger.hosts) == 3 and testbed.namespaces() != [] and len(testbed.namespaces()) == 3


def test_down_leaves_nothing_behind(state_dir: Path) -> None:
    testbed.up(2, state_dir=state_dir)
    pids = host_pids(state_dir)
    assert len(pids) == 2 and all(live(pid) for pid in pids)
    testbed.down(state_dir)
    assert testbed.namespaces() == []
    assert testbed.links() == []
    assert not state_dir.exists()
    assert not any(live(pid) for pid in pids)
    testbed.down(state_dir)  # nothing left to remove: not an error


def test_down_cleans_up_after_a_crashed_run(state_dir: Path) -> None:
    """What a run killed half-way through ``up`` leaves: a namespace, the bridge, no state."""
    subprocess.run(["ip", "netns", "add", "tdm-h7"], check=True)
    subprocess.run(["ip", "link", "add", testbed.BRIDGE, "type", "bridge"], check=True)
    testbed.down(state_dir)
    assert testbed.namespaces() == [] and testbed.links() == []


def test_not_root_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(testbed.os, "geteuid", lambda: 1000)
    with pytest.raises(TestbedUnavailable, match="needs root"):
        testbed.check_possible()


def test_a_missing_tool_is_named_with_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(testbed.os, "geteuid", lambda: 0)
    present = {"ip", "ssh", "ssh-keygen"}
    monkeypatch.setattr(testbed.shutil, "which", lambda tool: tool if tool in present else None)
    monkeypatch.setattr(testbed, "_apt", lambda: True)
    with pytest.raises(TestbedUnavailable, match="`rsync` not found: install rsync") as missing:
        testbed.check_possible()
    assert missing.value.installable  # root with apt: setup's job, a test fails on it
    assert "apt-get install openssh-server rsync" in str(missing.value)
    monkeypatch.setattr(testbed, "_apt", lambda: False)
    with pytest.raises(TestbedUnavailable) as missing:
        testbed.check_possible()
    assert not missing.value.installable  # no apt: the bed's tests skip, saying why


def test_the_cli_says_in_one_line_what_a_bed_lacks(tmp_path: Path) -> None:
    """A new user without rsync: `tandem chaos run host-loss --testbed 3` ends in one line
    naming the package to install, no traceback."""
    if os.geteuid() != 0:
        pytest.skip("the check after root's: needs root")
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("ip", "ssh", "ssh-keygen"):
        (tools / tool).symlink_to(shutil.which(tool) or f"/usr/bin/{tool}")
    tandem = Path(sys.executable).with_name("tandem")
    env = {**os.environ, "PATH": f"{tools}:{Path(sys.executable).parent}"}
    run = subprocess.run(
        [str(tandem), "chaos", "run", "host-loss", "--testbed", "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines[-1].startswith("tandem: the test bed cannot run here: `rsync` not found")
    assert "apt-get install openssh-server rsync" in lines[-1]
    assert "Traceback" not in run.stderr


def test_bad_shapes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one host"):
        testbed.up(0, state_dir=tmp_path)
    with pytest.raises(ValueError, match="no room for 7 hosts"):
        testbed.up(7, subnet="10.213.0.0/29", state_dir=tmp_path)


def test_ssh_args_use_the_beds_key(tmp_path: Path) -> None:
    bed = Testbed(
        [testbed.Host("tdm-h0", "10.213.0.1", "a")], "10.213.0.254", tmp_path / "k", tmp_path
    )
    args = bed.ssh_args(bed.hosts[0])
    assert args[:3] == ["ssh", "-i", str(tmp_path / "k")] and args[-1] == "root@10.213.0.1"


def test_the_cli_starts_and_removes_the_bed(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from tandem.cli import main

    assert main(["testbed", "up", "--nodes", "2", "--domains", "x,y"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(h["name"], h["address"], h["domain"]) for h in doc["hosts"]] == [
        ("tdm-h0", "10.213.0.1", "x"),
        ("tdm-h1", "10.213.0.2", "y"),
    ]
    assert main(["testbed", "down"]) == 0
    assert testbed.namespaces() == [] and testbed.links() == []


def reaches(src: str, address: str, timeout_s: float = 1.0) -> bool:
    """Whether a TCP connection from namespace ``src`` to ``address``:22 gets sshd's banner."""
    probe = (
        "import socket, sys\n"
        "try:\n"
        f"    c = socket.create_connection(({address!r}, 22), {timeout_s})\n"
        "    sys.exit(0 if c.recv(4) == b'SSH-' else 1)\n"
        "except OSError:\n"
        "    sys.exit(1)\n"
    )
    return subprocess.run(["ip", "netns", "exec", src, "python3", "-c", probe]).returncode == 0


def test_a_partitioned_host_is_cut_both_ways_until_healed(state_dir: Path) -> None:
    bed = testbed.up(3, state_dir=state_dir)
    h0, h1, h2 = bed.hosts
    assert reaches(h0.name, h1.address) and reaches(h1.name, h2.address)
    testbed.partition(h1)
    assert not reaches(h0.name, h1.address)  # in
    assert not reaches(h1.name, h2.address)  # out
    assert reaches(h0.name, h2.address)  # the others still talk
    assert all(live(pid) for pid in host_pids(state_dir))  # nothing died
    testbed.heal(h1)
    assert reaches(h0.name, h1.address) and reaches(h1.name, h2.address)


def netns_pids(name: str) -> list[str]:
    return subprocess.run(
        ["ip", "netns", "pids", name], capture_output=True, text=True
    ).stdout.split()


def test_a_killed_host_loses_every_process_until_revived(state_dir: Path) -> None:
    bed = testbed.up(2, state_dir=state_dir)
    h0, h1 = bed.hosts
    sleeper = subprocess.Popen(["ip", "netns", "exec", h1.name, "sleep", "60"])
    try:
        # `ip netns exec` enters the namespace after Popen returns: wait until it is there.
        deadline = time.monotonic() + 10.0
        while str(sleeper.pid) not in netns_pids(h1.name):
            assert time.monotonic() < deadline, "the sleeper never entered the host"
            time.sleep(0.02)
        killed = testbed.kill_host(h1)
        assert sleeper.wait(timeout=5) == -9 and sleeper.pid in killed
        assert not reaches(h0.name, h1.address)  # its sshd died with the rest
    finally:
        sleeper.kill()
    testbed.revive_host(bed, h1)
    assert reaches(h0.name, h1.address)


NODES_PROBE = (
    "import json, ray\n"
    "ray.init(address='10.213.0.1:6379', logging_level='ERROR', log_to_driver=False)\n"
    "print(json.dumps({n['NodeManagerAddress']: n['Labels'].get('tandem/failure-domain')\n"
    "                  for n in ray.nodes() if n['Alive']}))\n"
)


def test_ray_up_starts_a_cluster_labelled_by_host_on_the_bed(state_dir: Path) -> None:
    """`ray up` of the cluster file a 4-host bed of domains a, b writes: a head and three
    workers, each Ray node on its host's address with its host's failure domain, in turn (Ray's
    own node table); `ray down` then `tandem testbed down` leave nothing."""
    import json
    import sys

    bed = testbed.up(4, ["a", "b"])  # the default state dir: the cluster file reads it
    try:
        testbed.ray_up(bed.cluster_file)
        env = {"PATH": "/usr/bin:/bin", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
        nodes: dict[str, str] = {}
        deadline = time.monotonic() + 120
        while len(nodes) < 4 and time.monotonic() < deadline:
            time.sleep(2)
            out = subprocess.run(
                ["ip", "netns", "exec", "tdm-h0", sys.executable, "-c", NODES_PROBE],
                capture_output=True,
                text=True,
                env=env,
                timeout=120,
            )
            if out.returncode == 0:
                nodes = json.loads(out.stdout.strip().splitlines()[-1])
        assert nodes == {"10.213.0.1": "a", "10.213.0.2": "b", "10.213.0.3": "a", "10.213.0.4": "b"}
        testbed.ray_down(bed.cluster_file, check=True)
    finally:
        testbed.down()
    assert testbed.namespaces() == [] and testbed.links() == []


def test_the_cluster_file_is_written_for_the_beds_hosts_and_domains() -> None:
    """deploy/cluster-testbed.yaml is the 3-host case of what ``tandem testbed up`` writes;
    another bed gets its own hosts, each worker's domain found by its address."""
    import yaml

    home = Path.home() / ".cache" / "tandem" / "testbed"

    def bed(n: int, domains: str, state: Path = home) -> Testbed:
        hosts = [
            Host(f"tdm-h{i}", f"10.213.0.{i + 1}", domains[i % len(domains)]) for i in range(n)
        ]
        return Testbed(hosts, "10.213.0.254", state / "id_ed25519", state)

    shipped = yaml.safe_load(testbed.CLUSTER_FILE.read_text())
    assert testbed.cluster_config(bed(3, "abc")) == shipped
    five = testbed.cluster_config(bed(5, "ab", Path("/srv/bed")))
    assert five["provider"]["head_ip"] == "10.213.0.1"
    assert five["provider"]["worker_ips"] == [f"10.213.0.{i}" for i in range(2, 6)]
    assert five["auth"]["ssh_private_key"] == "/srv/bed/id_ed25519"
    head, worker = five["head_start_ray_commands"][1], five["worker_start_ray_commands"][1]
    assert head.endswith("--labels=tandem/failure-domain=a") and "cat /srv/bed/checkout" in head
    arms = [f'*" 10.213.0.{i + 1} "*) host=tdm-h{i}; domain={"ab"[i % 2]} ;;' for i in range(1, 5)]
    assert all(arm in worker for arm in arms) and "10.213.0.1 " not in worker
