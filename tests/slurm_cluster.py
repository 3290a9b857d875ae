"""A real single-node Slurm cluster on localhost for the tests, started without systemd.

Debian's slurmctld, slurmd, slurmdbd, munge and mariadb-server, each started in the foreground
as a child of the test process, with every file (configs, state, spool, logs, database, munge
socket) in one fresh temporary folder. A fresh folder is the wipe the cluster needs at each
start: state or a database from an earlier start would restart job ids at 1 beside old jobs of
the same ids. Accounting (slurmdbd on MariaDB) is not optional: without it, submitit cannot learn
the state of a job that died without writing its result, and waits for it forever.

`SlurmCluster.start()` returns a running cluster or raises `SlurmUnavailable` with the reason
(not root, a binary missing, a daemon that would not come up); `stop()` ends every daemon by
the PID it was started with. The jobs find the cluster through $SLURM_CONF (`cluster.env`).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

# The binaries, and the Debian packages that hold them (what .ci/run installs when one is missing).
BINARIES = {"slurmctld": "slurmctld", "slurmd": "slurmd", "slurmdbd": "slurmdbd", "sbatch": "slurm-client",
            "munged": "munge", "mariadbd": "mariadb-server", "mariadb-install-db": "mariadb-server",
            "mariadb": "mariadb-server"}
PARTITION = "bbtest"
CLUSTER = "bbtest"
PORTS = {"slurmctld": 6817, "slurmd": 6818, "slurmdbd": 6819}
START_TIMEOUT_S = 60


class SlurmUnavailable(RuntimeError):
    """Slurm can't be started here; the message says why."""


def missing_binaries() -> list[str]:
    return [name for name in BINARIES if shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]


def binary(name: str) -> str:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") or name


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def node_resources() -> tuple[str, int, int]:
    """(host name, CPUs, memory in MB) as slurmd itself sees this machine (`slurmd -C`)."""
    out = subprocess.run([binary("slurmd"), "-C"], capture_output=True, text=True, timeout=30, check=True).stdout
    fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
    return fields["NodeName"], int(fields["CPUs"]), int(fields["RealMemory"])


class SlurmCluster:
    """One slurmctld + slurmd + slurmdbd + MariaDB + munged, all under `self.root`."""

    def __init__(self, cpus: int = 2) -> None:
        self.cpus = cpus
        self.root: Path | None = None
        self.daemons: dict[str, subprocess.Popen] = {}
        self.env: dict[str, str] = {}

    # -- files ----------------------------------------------------------------------------------
    def path(self, *parts: str) -> Path:
        assert self.root is not None
        return self.root.joinpath(*parts)

    def slurm_conf(self, host: str, memory_mb: int) -> str:
        r = self.path
        return f"""\
ClusterName={CLUSTER}
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={PORTS['slurmctld']}
SlurmdPort={PORTS['slurmd']}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r('munge', 'munge.socket')},cred_expire=10
StateSaveLocation={r('state')}
SlurmdSpoolDir={r('spool')}
SlurmctldPidFile={r('run', 'slurmctld.pid')}
SlurmdPidFile={r('run', 'slurmd.pid')}
SlurmctldLogFile={r('log', 'slurmctld.log')}
SlurmdLogFile={r('log', 'slurmd.log')}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerParameters=batch_sched_delay=0,sched_interval=5
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={PORTS['slurmdbd']}
AccountingStoragePass={r('munge', 'munge.socket')}
MailProg=/bin/true
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
KillWait=5
MinJobAge=600
NodeName={host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    def slurmdbd_conf(self) -> str:
        r = self.path
        return f"""\
AuthType=auth/munge
AuthInfo=socket={r('munge', 'munge.socket')}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={PORTS['slurmdbd']}
SlurmUser=root
PidFile={r('run', 'slurmdbd.pid')}
LogFile={r('log', 'slurmdbd.log')}
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
"""

    # -- start / stop ---------------------------------------------------------------------------
    def start(self) -> "SlurmCluster":
        if os.geteuid() != 0:
            raise SlurmUnavailable("starting Slurm's daemons needs root (slurmd runs jobs as their user)")
        missing = missing_binaries()
        if missing:
            packages = sorted({BINARIES[name] for name in missing})
            raise SlurmUnavailable(f"{', '.join(missing)} not found; install the Debian packages {' '.join(packages)}")
        busy = [f"{name} ({port})" for name, port in PORTS.items() if port_in_use(port)]
        if busy:
            raise SlurmUnavailable(f"port in use on 127.0.0.1: {', '.join(busy)}; another Slurm is running")
        host, cpus, memory_mb = node_resources()
        self.cpus = min(self.cpus, cpus)  # more than the machine has would leave the node drained
        self.root = Path(tempfile.mkdtemp(prefix="backdoorbench-slurm-"))
        self.root.chmod(0o755)  # munged and mariadbd run as their own users below it
        for folder in ("state", "spool", "run", "log", "etc"):
            self.path(folder).mkdir()
        try:
            self.start_munge()
            self.start_mariadb()
            self.write(self.path("etc", "slurm.conf"), self.slurm_conf(host, memory_mb), 0o644)
            self.write(self.path("etc", "slurmdbd.conf"), self.slurmdbd_conf(), 0o600)  # slurmdbd insists
            self.env = {"SLURM_CONF": str(self.path("etc", "slurm.conf"))}
            self.spawn("slurmdbd", [binary("slurmdbd"), "-D"], env={"SLURM_CONF": str(self.path("etc", "slurm.conf"))})
            self.wait_for(lambda: port_in_use(PORTS["slurmdbd"]), "slurmdbd listening", "slurmdbd")
            self.spawn("slurmctld", [binary("slurmctld"), "-D", "-i", "-f", str(self.path("etc", "slurm.conf"))])
            self.wait_for(lambda: port_in_use(PORTS["slurmctld"]), "slurmctld listening", "slurmctld")
            self.spawn("slurmd", [binary("slurmd"), "-D", "-f", str(self.path("etc", "slurm.conf"))])
            self.wait_for(self.node_idle, "the node idle in sinfo", "slurmd")
        except BaseException:
            self.stop()
            raise
        return self

    def write(self, path: Path, text: str, mode: int) -> None:
        path.write_text(text)
        path.chmod(mode)

    def start_munge(self) -> None:
        munge = pwd.getpwnam("munge")
        folder = self.path("munge")
        folder.mkdir()
        folder.chmod(0o755)  # munged: the socket folder must be searchable by all, writable by it alone
        key = folder / "munge.key"  # a key of our own: no dependence on /etc/munge's
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for path in (folder, key):
            os.chown(path, munge.pw_uid, munge.pw_gid)
        self.spawn("munged", [binary("munged"), "--foreground", f"--socket={folder / 'munge.socket'}",
                              f"--key-file={key}", f"--pid-file={folder / 'munged.pid'}",
                              f"--log-file={folder / 'munged.log'}", f"--seed-file={folder / 'munged.seed'}"],
                   user=munge.pw_uid, group=munge.pw_gid, log=folder / "munged.out")
        self.wait_for(lambda: (folder / "munge.socket").exists(), "the munge socket", "munged")

    def start_mariadb(self) -> None:
        mysql = pwd.getpwnam("mysql")
        data, sock = self.path("mysql"), self.path("mysql", "mysqld.sock")
        data.mkdir()
        os.chown(data, mysql.pw_uid, mysql.pw_gid)
        init = subprocess.run([binary("mariadb-install-db"), "--no-defaults", f"--datadir={data}", "--user=mysql",
                               "--auth-root-authentication-method=socket", "--skip-test-db"],
                              capture_output=True, text=True, timeout=120)
        if init.returncode != 0:
            raise SlurmUnavailable(f"mariadb-install-db failed: {(init.stdout + init.stderr).strip()[-2000:]}")
        self.spawn("mariadbd", [binary("mariadbd"), "--no-defaults", f"--datadir={data}", "--user=mysql",
                                "--skip-networking", f"--socket={sock}", f"--pid-file={data / 'mariadbd.pid'}",
                                f"--log-error={self.path('log', 'mariadbd.log')}"])
        self.wait_for(lambda: sock.exists(), "the MariaDB socket", "mariadbd")
        created = subprocess.run([binary("mariadb"), "--no-defaults", f"--socket={sock}", "-u", "root", "-e",
                                  "CREATE DATABASE slurm_acct_db"], capture_output=True, text=True, timeout=60)
        if created.returncode != 0:
            raise SlurmUnavailable(f"creating slurm_acct_db failed: {created.stderr.strip()}")
        # slurmdbd takes no socket option: libmariadb connects to "localhost" through this one.
        self.mysql_socket = str(sock)

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None, log: Path | None = None,
              **kwargs) -> None:
        env = {**os.environ, **(env or {})}
        if getattr(self, "mysql_socket", None):
            env["MYSQL_UNIX_PORT"] = self.mysql_socket
        out = open(log or self.path("log", f"{name}.out"), "w")
        self.daemons[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              env=env, start_new_session=True, **kwargs)
        out.close()

    def wait_for(self, ready, what: str, daemon: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            proc = self.daemons[daemon]
            if proc.poll() is not None:
                raise SlurmUnavailable(f"{daemon} exited with {proc.returncode} before {what}:\n{self.logs(daemon)}")
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"no {what} after {START_TIMEOUT_S} s:\n{self.logs(daemon)}")
            time.sleep(0.1)

    def node_idle(self) -> bool:
        out = self.slurm("sinfo", "--noheader", "--format=%t", check=False)
        return out.returncode == 0 and out.stdout.strip() == "idle"

    def slurm(self, command: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster."""
        return subprocess.run([binary(command), *args], env={**os.environ, **self.env}, capture_output=True,
                              text=True, timeout=60, check=check)

    def logs(self, daemon: str) -> str:
        """The tail of a daemon's log files, for failure messages."""
        tails = []
        for path in sorted(self.path("log").glob(f"{daemon}*")) + sorted(self.path("munge").glob(f"{daemon}*")):
            with open(path, errors="replace") as f:
                tails.append(f"--- {path.name}\n" + "".join(f.readlines()[-30:]))
        return "\n".join(tails)

    def cancel_jobs(self) -> None:
        """Cancel the jobs still queued or running and wait for them to leave the queue: a job's
        slurmstepd outlives slurmd, so a job left running at the stop would stay behind."""
        ctld = self.daemons.get("slurmctld")
        if ctld is None or ctld.poll() is not None:
            return
        deadline = time.monotonic() + 30
        while jobs := self.slurm("squeue", "--noheader", "--format=%A", check=False).stdout.split():
            if time.monotonic() > deadline:
                break
            self.slurm("scancel", *jobs, check=False)
            time.sleep(0.5)

    def stop(self) -> None:
        """Cancel the jobs left, end every daemon by its PID (the reverse of the start order), then
        drop the folder."""
        self.cancel_jobs()
        for name, proc in reversed(list(self.daemons.items())):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.daemons.clear()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
