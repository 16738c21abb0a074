"""Smoke test of the images (``make docker-test``): a directory container and worker containers on a
podman network made for the test, driven for real.

1. The directory container (token from a podman secret) is started and waited on through its own
   health check.
2. Broadcast: a producer puts 64 MiB; three consumers get it at once. The victim's incoming link is
   limited (``tc tbf`` on its veth) so that its transfer is still running when it is SIGKILLed, as
   soon as 8 MiB reached it; the other consumers must finish bit-exact.
3. Reduce: the three survivors put 16 MiB inputs; the producer reduces them (SUM) and checks the
   result bit for bit.
4. The directory container is SIGKILLed and started again. The nodes reconnect and restore their
   copies: a survivor puts a new object that another gets, and a consumer started afterwards gets
   the broadcast object and one reduce input, which only the restored directory can locate.

Everything it starts (containers, network, secret, the tbf qdisc) carries the run's name and is
removed at the end, also when a step fails; leftovers of an interrupted earlier run are removed
first. Prints the steps and a JSON summary; exits 1 on failure.

Usage: python docker/smoke.py [--tag TAG] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LABEL = "hoplite-smoke"
PODMAN = os.environ.get("PODMAN", "podman")
MiB = 1 << 20
BCAST_BYTES = 64 * MiB
REDUCE_BYTES = 16 * MiB
VICTIM_RATE = "200mbit"  # 64 MiB take 2.7 s to reach the victim
KILL_AFTER_BYTES = 8 * MiB
STEP_TIMEOUT = 120.0


class SmokeError(RuntimeError):
    """A step of the smoke test failed."""


def podman(*args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a podman command, raising SmokeError when it fails (``check``) or runs too long."""
    try:
        done = subprocess.run([PODMAN, *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise SmokeError(f"podman {' '.join(args[:3])} took more than {timeout} s") from exc
    if check and done.returncode != 0:
        raise SmokeError(f"podman {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def cleanup(run: str | None = None) -> None:
    """Remove containers, networks and secrets of the smoke test (of one run, or of every run)."""
    prefix = run or "hoplite-smoke-"
    label = f"{LABEL}={run}" if run else LABEL
    ids = podman("ps", "-aq", "--filter", f"label={label}", check=False).stdout.split()
    if ids:
        podman("rm", "-f", "-t", "0", *ids, check=False)
    for kind in ("network", "secret"):
        names = podman(kind, "ls", "--format", "{{.Name}}", check=False).stdout.split()
        for name in names:
            if name.startswith(prefix):
                podman(kind, "rm", name, check=False)


class Member:
    """A worker container running ``docker/smoke_worker.py``, attached over stdin/stdout."""

    def __init__(self, name: str, image: str, run: str, network: str, directory: str, logdir: Path):
        self.name = name
        self.log = logdir / f"{name}.log"
        cmd = [
            PODMAN, "run", "-i", "--name", name, "--label", f"{LABEL}={run}", "--network", network,
            "--secret", f"{run}-token,target=hoplite_token", "--shm-size", "512m",
            "-e", f"HOPLITE_DIRECTORY={directory}", image,
            "python3", "/opt/hoplite_gpu/docker/smoke_worker.py",
        ]  # fmt: skip
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1
            )
        self.ready = self.reply(STEP_TIMEOUT)

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout: float) -> dict[str, Any]:
        """The next reply, which must say ok (SmokeError otherwise, or after ``timeout`` seconds)."""
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise SmokeError(f"{self.name}: no reply in {timeout} s; its log: {self.tail()}")
        line = self.proc.stdout.readline()
        if not line:
            raise SmokeError(f"{self.name} exited ({self.proc.wait(10)}); its log: {self.tail()}")
        msg: dict[str, Any] = json.loads(line)
        if not msg.get("ok"):
            raise SmokeError(f"{self.name}: {msg}; its log: {self.tail()}")
        return msg

    def call(self, **cmd: Any) -> dict[str, Any]:
        """Send a command and wait for its reply (a little longer than the command's own timeout)."""
        self.send(**cmd)
        return self.reply(cmd.get("timeout", STEP_TIMEOUT) + 30)

    def tail(self) -> str:
        return self.log.read_text()[-2000:] if self.log.exists() else ""

    def exit(self) -> int:
        """Ask it to leave; its container's exit status."""
        if self.proc.poll() is None:
            self.send(op="exit")
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def wait_healthy(container: str, timeout: float = 60.0) -> float:
    """Run the container's health check until it passes; seconds it took."""
    start = time.monotonic()
    while True:
        if podman("healthcheck", "run", container, check=False, timeout=30).returncode == 0:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise SmokeError(f"{container} not healthy after {timeout} s: {podman('logs', container).stderr}")


def host_veth(container: str) -> str:
    """The host end of a container's eth0."""
    peer = int(podman("exec", container, "cat", "/sys/class/net/eth0/iflink").stdout)
    for dev in os.listdir("/sys/class/net"):
        if Path(f"/sys/class/net/{dev}/ifindex").read_text().strip() == str(peer):
            return dev
    raise SmokeError(f"no host interface with index {peer} (the veth of {container})")


def tx_bytes(dev: str, default: int | None = None) -> int:
    """Bytes the host sent through ``dev`` (``default`` when the interface is gone: a killed
    container's veth goes with its network namespace; while it is being torn down, the read
    fails with EINVAL or ENODEV instead of ENOENT)."""
    try:
        return int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())
    except OSError:
        if default is None:
            raise
        return default


def smoke(tag: str, logdir: Path) -> dict[str, Any]:
    run = f"hoplite-smoke-{os.getpid()}"
    network, directory = f"{run}-net", f"{run}-dir"
    worker, dir_image = f"localhost/hoplite-gpu-worker:{tag}", f"localhost/hoplite-gpu-directory:{tag}"
    summary: dict[str, Any] = {"run": run}
    members: dict[str, Member] = {}
    veth = ""
    cleanup()  # an interrupted earlier run
    try:
        # The directory keeps its address and MAC across its restart, as a host of a real cluster
        # would. Podman's network gives a restarted container new ones: its DNS (aardvark-dns
        # 1.4) then stopped answering for 5-40 s, and with only the address fixed the nodes' ARP
        # entries kept the old MAC for more than a node's reconnect_timeout (30 s).
        octet = os.getpid() % 250
        subnet = f"10.213.{octet}"
        podman("network", "create", "--label", f"{LABEL}={run}", "--subnet", f"{subnet}.0/24", network)
        token = Path(tempfile.mkstemp(dir=logdir)[1])
        token.write_text(secrets.token_urlsafe(32))
        podman("secret", "create", f"{run}-token", str(token))
        token.unlink()
        # No systemd timer here to run the health check: --health-interval disable keeps it for
        # `podman healthcheck run`, which this test calls itself.
        podman(
            "run", "-d", "--name", directory, "--label", f"{LABEL}={run}", "--network", network,
            "--ip", f"{subnet}.2", "--mac-address", f"02:42:0a:d5:{octet:02x}:02",
            "--secret", f"{run}-token,target=hoplite_token",
            "--health-interval", "disable", dir_image,
        )  # fmt: skip
        summary["directory_healthy_s"] = round(wait_healthy(directory), 2)
        print(f"directory {directory} healthy after {summary['directory_healthy_s']} s", flush=True)
        address = f"{subnet}.2:7070"
        for name in ("producer", "c1", "c2", "c3"):
            members[name] = Member(f"{run}-{name}", worker, run, network, address, logdir)
        producer, c1, victim, c3 = (members[n] for n in ("producer", "c1", "c2", "c3"))

        # ---- broadcast, a consumer killed mid-transfer
        producer.call(op="put", name="bcast", seed=1, size=BCAST_BYTES)
        veth = host_veth(victim.name)
        subprocess.run(
            ["tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate", VICTIM_RATE, "burst", "256kb",
             "latency", "100ms"], check=True, timeout=10,
        )  # fmt: skip
        base = tx_bytes(veth)
        start = time.monotonic()
        for m in (c1, victim, c3):
            m.send(op="get", name="bcast", seeds=[1], timeout=STEP_TIMEOUT)
        while (sent := tx_bytes(veth)) - base < KILL_AFTER_BYTES:
            if time.monotonic() - start > 60:
                raise SmokeError(f"the victim received {sent - base} bytes in 60 s")
            if victim.proc.poll() is not None:
                raise SmokeError(f"the victim exited before it was killed: {victim.tail()}")
            time.sleep(0.01)  # polling a counter: the kill must land while the transfer runs
        podman("kill", "-s", "KILL", victim.name)
        # Read again after the kill (what it received up to its death), or, if the veth is gone
        # already, the count that triggered the kill.
        received = tx_bytes(veth, default=sent) - base
        if received >= BCAST_BYTES:
            raise SmokeError(f"the victim had all {received} bytes before the kill")
        summary["victim_bytes_at_kill"] = received
        print(f"victim killed after receiving {received / MiB:.1f} of {BCAST_BYTES // MiB} MiB", flush=True)
        for m in (c1, c3):
            got = m.reply(STEP_TIMEOUT + 30)
            if not got["exact"]:
                raise SmokeError(f"{m.name} got a broadcast that differs: {got}")
            summary[f"broadcast_{m.name.rsplit('-', 1)[1]}_s"] = got["seconds"]
        summary["broadcast_s"] = round(time.monotonic() - start, 2)
        print(f"broadcast of 64 MiB: both survivors bit-exact in {summary['broadcast_s']} s", flush=True)
        who = {m.ready["node_id"]: short for short, m in members.items()}
        ends = {True: "ok", False: "failed", None: "no report"}
        summary["broadcast_transfers"] = [
            f"{who.get(t['sender'], '?')} -> {who.get(t['receiver'], '?')}"
            f"{' (relay)' if t['relay'] else ''}: {ends[t['ok']]}"
            for t in producer.call(op="transfers", name="bcast")["transfers"]
        ]
        print("transfers of the broadcast: " + "; ".join(summary["broadcast_transfers"]), flush=True)
        summary["victim_exit"] = victim.proc.wait(30)

        # ---- reduce among the survivors
        seeds = {"producer": 11, "c1": 12, "c3": 13}
        for name, seed in seeds.items():
            members[name].call(op="put", name=f"in-{name}", seed=seed, size=REDUCE_BYTES)
        got = producer.call(op="reduce", names=[f"in-{n}" for n in seeds], seeds=list(seeds.values()),
                            timeout=STEP_TIMEOUT)  # fmt: skip
        if not got["exact"]:
            raise SmokeError(f"the reduce result differs: {got}")
        summary["reduce_s"] = got["seconds"]
        print(f"reduce of 3 x 16 MiB: bit-exact in {got['seconds']} s", flush=True)

        # ---- the directory killed and started again
        podman("kill", "-s", "KILL", directory)
        start = time.monotonic()
        podman("start", directory)
        summary["directory_restart_healthy_s"] = round(wait_healthy(directory), 2)
        c3.call(op="put", name="after", seed=21, size=REDUCE_BYTES)
        got = producer.call(op="get", name="after", seeds=[21], timeout=STEP_TIMEOUT)
        if not got["exact"]:
            raise SmokeError(f"a get after the restart differs: {got}")
        late = members["c4"] = Member(f"{run}-c4", worker, run, network, address, logdir)
        for name, want in (("bcast", [1]), ("in-c1", [12])):
            got = late.call(op="get", name=name, seeds=want, timeout=STEP_TIMEOUT)
            if not got["exact"]:
                raise SmokeError(f"{name} fetched after the restart differs: {got}")
        summary["after_restart_s"] = round(time.monotonic() - start, 2)
        print(
            f"directory SIGKILLed and restarted: nodes reconnected, a new put/get and restored objects "
            f"bit-exact within {summary['after_restart_s']} s of the restart",
            flush=True,
        )
        codes = {name: m.exit() for name, m in members.items() if m is not victim}
        if any(codes.values()):
            raise SmokeError(f"members exited with {codes}")
        summary["ok"] = True
        return summary
    finally:
        for m in members.values():
            if m.proc.poll() is None:
                m.proc.kill()
                m.proc.wait(10)
        if veth and os.path.exists(f"/sys/class/net/{veth}"):
            subprocess.run(["tc", "qdisc", "del", "dev", veth, "root"], capture_output=True, timeout=10)
        cleanup(run)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default="latest", help="image tag (built by docker/build.sh)")
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hoplite-smoke-") as tmp:
        try:
            summary = smoke(args.tag, Path(tmp))
        except SmokeError as exc:
            print(f"smoke test FAILED: {exc}", file=sys.stderr)
            return 1
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
