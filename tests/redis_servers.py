"""Real local Redis deployments for the tests: a Redis Cluster and a Sentinel set.

Each one runs `redis-server` processes on free loopback ports, in a temporary folder of its
own, and stops every process it started. The session fixtures in `tests/conftest.py` start
them on first use. Off CI a machine without `redis-server` skips the tests that need them;
with `APIKEYS_REQUIRE_SERVICES=1` they fail instead.

- `LocalCluster`: 6 nodes, 3 masters and 3 replicas, made with `redis-cli --cluster create`.
- `LocalSentinel`: 1 master, 1 replica and 3 sentinels watching service `apikeys`.

Both can kill a master (`SIGKILL`), wait for the failover, and bring the killed node back as
a replica (`restore`), so a test that kills one leaves the deployment as it found it.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import services

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
SERVICE_NAME = "apikeys"


def require_redis_binaries() -> None:
    """Skip (or fail, when services are required) unless redis-server and redis-cli exist."""
    if REDIS_SERVER and REDIS_CLI:
        return
    message = "redis-server and redis-cli are needed to start a local Redis Cluster or Sentinel"
    if services.REQUIRE_SERVICES:
        pytest.fail(message + " [APIKEYS_REQUIRE_SERVICES=1]")
    pytest.skip(message)


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(taken: set[int]) -> int:
    """A free loopback port whose cluster bus port (+10000) is free too."""
    for _ in range(1000):
        port = random.randint(20000, 45000)
        if port in taken or port + 10000 in taken:
            continue
        if _port_free(port) and _port_free(port + 10000):
            taken.update((port, port + 10000))
            return port
    raise RuntimeError("no free port pair found")


def wait_until(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll `check` until it is true; fail after `timeout` seconds (a bound, not a timing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def cli(port: int, *args: str) -> str:
    """`redis-cli -p port args…`, its output."""
    assert REDIS_CLI is not None
    done = subprocess.run(
        [REDIS_CLI, "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"redis-cli {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def info(port: int, section: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in cli(port, "INFO", section).splitlines():
        name, sep, value = line.strip().partition(":")
        if sep:
            fields[name] = value
    return fields


class Node:
    """One `redis-server` process on a port, with its own folder."""

    def __init__(self, root: Path, port: int, args: list[str], *, sentinel: bool = False) -> None:
        self.port = port
        self.dir = root / str(port)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.args = args
        self.sentinel = sentinel
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert REDIS_SERVER is not None
        command = [REDIS_SERVER]
        if self.sentinel:
            command += [str(self.dir / "sentinel.conf"), "--sentinel"]
        command += [
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--logfile",
            str(self.dir / "redis.log"),
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
        ]
        if not self.sentinel:
            command += ["--save", "", "--appendonly", "no"]
            # A replica's full sync starts at once: by default a master waits 5 seconds for
            # more replicas to share one diskless transfer, which every deployment start, every
            # restored node and every new replica here would wait out.
            command += ["--repl-diskless-sync-delay", "0"]
        self.process = subprocess.Popen(
            command + self.args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_until(lambda: cli(self.port, "PING").strip() == "PONG", f"redis on {self.port}")

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: a crash, with no chance to hand over."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


class LocalCluster:
    """A Redis Cluster of 3 masters and 3 replicas on loopback, in a temporary folder."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="apikeys-cluster-"))
        taken: set[int] = set()
        self.nodes = [
            Node(
                self.root,
                free_port(taken),
                [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "1000",
                    # A replica takes over however long it was cut off from its master.
                    "--cluster-replica-validity-factor",
                    "0",
                ],
            )
            for _ in range(6)
        ]

    @property
    def url(self) -> str:
        """`redis+cluster://` with every node, as a deployment would list them."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    def start(self) -> None:
        try:
            for node in self.nodes:
                node.start()
            cli(
                self.nodes[0].port,
                "--cluster",
                "create",
                *(f"127.0.0.1:{node.port}" for node in self.nodes),
                "--cluster-replicas",
                "1",
                "--cluster-yes",
            )
            self.wait_healthy()
        except BaseException:
            self.close()
            raise

    def _live(self) -> Node:
        return next(node for node in self.nodes if node.running)

    def masters(self) -> list[Node]:
        """The running nodes that are masters with slots, as the cluster says."""
        ports = set()
        for line in cli(self._live().port, "CLUSTER", "NODES").splitlines():
            parts = line.split()
            flags = parts[2].split(",")
            if "master" in flags and "fail" not in flags and len(parts) > 8:
                ports.add(int(parts[1].split(":")[1].split("@")[0]))
        return [node for node in self.nodes if node.port in ports and node.running]

    def wait_healthy(self) -> None:
        """Every running node says `cluster_state:ok`, 3 masters hold the slots, and each has
        a replica in sync."""

        def healthy() -> bool:
            for node in self.nodes:
                if node.running and info_cluster(node.port).get("cluster_state") != "ok":
                    return False
            masters = self.masters()
            if len(masters) < 3:  # more after `add_master` and a resharding
                return False
            return all(
                int(info(master.port, "replication").get("connected_slaves", "0")) >= 1
                and _replicas_in_sync(master.port)
                for master in masters
            )

        wait_until(healthy, "the Redis Cluster to be healthy", timeout=90)

    def master_of(self, key: str) -> Node:
        slot = int(cli(self._live().port, "CLUSTER", "KEYSLOT", key).strip())
        for line in cli(self._live().port, "CLUSTER", "NODES").splitlines():
            parts = line.split()
            flags = parts[2].split(",")
            if "master" not in flags or "fail" in flags:
                continue
            for spec in parts[8:]:
                low, _, high = spec.partition("-")
                if low.startswith("["):
                    continue
                if int(low) <= slot <= int(high or low):
                    port = int(parts[1].split(":")[1].split("@")[0])
                    return next(node for node in self.nodes if node.port == port)
        raise RuntimeError(f"no master serves {key!r}")

    def kill_master(self, key: str) -> Node:
        """Kill the master that serves `key`'s slot; return it (to `restore` it later)."""
        node = self.master_of(key)
        node.kill()
        return node

    def wait_failover(self, killed: Node) -> None:
        """Wait until a replica has taken over the killed master's slots."""

        def taken_over() -> bool:
            live = self._live()
            if info_cluster(live.port).get("cluster_state") != "ok":
                return False
            for line in cli(live.port, "CLUSTER", "NODES").splitlines():
                parts = line.split()
                port = int(parts[1].split(":")[1].split("@")[0])
                if port == killed.port and len(parts) > 8:
                    return False  # it still holds slots: nobody has taken over yet
            return True

        wait_until(taken_over, "the cluster failover", timeout=90)

    def restore(self, node: Node) -> None:
        """Start a killed node again: it rejoins as a replica; wait for a healthy cluster."""
        if not node.running:
            node.start()
        self.wait_healthy()

    def add_master(self) -> Node:
        """Start a master with a replica and join both to the cluster; the master holds no
        slot (as after `redis-cli --cluster add-node`, before a resharding moves any)."""
        taken = {port for node in self.nodes for port in (node.port, node.port + 10000)}
        master, replica = (Node(self.root, free_port(taken), self.nodes[0].args) for _ in range(2))
        self.nodes += [master, replica]
        live = f"127.0.0.1:{self._live().port}"
        master.start()
        cli(master.port, "--cluster", "add-node", f"127.0.0.1:{master.port}", live)
        replica.start()
        master_id = node_id(master.port)
        cli(replica.port, "CLUSTER", "MEET", "127.0.0.1", str(self._live().port))
        wait_until(
            lambda: master_id in cli(replica.port, "CLUSTER", "NODES"), "the new nodes to meet"
        )
        cli(replica.port, "CLUSTER", "REPLICATE", master_id)
        wait_until(lambda: _replicas_in_sync(master.port), "the new master's replica")
        wait_until(
            lambda: all(
                master_id in cli(node.port, "CLUSTER", "NODES")
                for node in self.nodes
                if node.running
            ),
            "every node to know the new master",
        )
        # The new nodes too say `cluster_state:ok` (until they do, the new master answers
        # CLUSTERDOWN, to a MIGRATE as to any command).
        self.wait_healthy()
        return master

    def close(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def node_id(port: int) -> str:
    """The cluster node id of the node on `port`."""
    return cli(port, "CLUSTER", "MYID").strip()


def info_cluster(port: int) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in cli(port, "CLUSTER", "INFO").splitlines():
        name, sep, value = line.strip().partition(":")
        if sep:
            fields[name] = value
    return fields


def _replicas_in_sync(port: int) -> bool:
    fields = info(port, "replication")
    offset = int(fields.get("master_repl_offset", "0"))
    replicas = [value for name, value in fields.items() if name.startswith("slave")]
    for replica in replicas:
        parts = dict(item.split("=", 1) for item in replica.split(","))
        if parts.get("state") != "online" or int(parts.get("offset", "-1")) < offset - 1024:
            return False
    return bool(replicas)


class LocalSentinel:
    """A master, a replica and 3 sentinels watching them as service `apikeys`."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="apikeys-sentinel-"))
        taken: set[int] = set()
        master_port = free_port(taken)
        self.data = [
            Node(self.root, master_port, []),
            Node(self.root, free_port(taken), ["--replicaof", "127.0.0.1", str(master_port)]),
        ]
        self.sentinels = [Node(self.root, free_port(taken), [], sentinel=True) for _ in range(3)]

    @property
    def url(self) -> str:
        """`redis+sentinel://` with every sentinel and the service name."""
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE_NAME}"

    def start(self) -> None:
        try:
            for node in self.data:
                node.start()
            wait_until(
                lambda: _replicas_in_sync(self.data[0].port), "the replica to sync", timeout=60
            )
            for sentinel in self.sentinels:
                (sentinel.dir / "sentinel.conf").write_text(
                    f"sentinel monitor {SERVICE_NAME} 127.0.0.1 {self.data[0].port} 2\n"
                    f"sentinel down-after-milliseconds {SERVICE_NAME} 1000\n"
                    f"sentinel failover-timeout {SERVICE_NAME} 5000\n"
                    f"sentinel parallel-syncs {SERVICE_NAME} 1\n"
                )
                sentinel.start()
            self.wait_healthy()
        except BaseException:
            self.close()
            raise

    def master_port(self) -> int:
        for sentinel in self.sentinels:
            if sentinel.running:
                reply = cli(sentinel.port, "SENTINEL", "get-master-addr-by-name", SERVICE_NAME)
                return int(reply.split()[1])
        raise RuntimeError("no sentinel is running")

    def master(self) -> Node:
        port = self.master_port()
        return next(node for node in self.data if node.port == port)

    def wait_healthy(self) -> None:
        """The sentinels agree on a running master that has its replica in sync, and each
        sentinel knows the other two."""

        def healthy() -> bool:
            master = self.master()
            if not master.running or info(master.port, "replication").get("role") != "master":
                return False
            if not _replicas_in_sync(master.port):
                return False
            for sentinel in self.sentinels:
                fields = dict(
                    zip(
                        *[iter(cli(sentinel.port, "SENTINEL", "master", SERVICE_NAME).split())] * 2,
                        strict=True,
                    )
                )
                if int(fields.get("num-other-sentinels", "0")) < 2:
                    return False
                if int(fields.get("port", "0")) != master.port:
                    return False
            return True

        wait_until(healthy, "the Sentinel set to be healthy", timeout=90)

    def kill_master(self) -> Node:
        node = self.master()
        node.kill()
        return node

    def wait_failover(self, killed: Node) -> None:
        """Until every running sentinel names a new master, which says it is one."""

        def promoted() -> bool:
            ports = {
                int(cli(s.port, "SENTINEL", "get-master-addr-by-name", SERVICE_NAME).split()[1])
                for s in self.sentinels
                if s.running
            }
            if len(ports) != 1 or killed.port in ports:
                return False
            return info(ports.pop(), "replication").get("role") == "master"

        wait_until(promoted, "the Sentinel failover", timeout=90)

    def restore(self, node: Node) -> None:
        """Start the killed master again, as a replica of the new one (what the sentinels'
        rewrite of its configuration makes of it in a real deployment): it never answers
        as an empty master, which a client still holding its address would read from."""
        if not node.running:
            master = self.master_port()
            node.args = ["--replicaof", "127.0.0.1", str(master)]  # a data node's only args
            node.start()
        self.wait_healthy()

    def close(self) -> None:
        for node in [*self.sentinels, *self.data]:
            node.stop()
        shutil.rmtree(self.root, ignore_errors=True)
