"""One writer per run directory: a lease that the training process renews.

``trainforge train`` holds ``OUTPUT/lease.json`` for its whole life (under torchrun, rank 0
holds it for the job). The file records who holds it (host, pid, when it started, the
command) and when it was last renewed; a thread renews it every ``timeout / 6`` seconds.
A ``flock`` would not do: on NFS and Lustre it is either missing, local to one client, or
left behind by a node that died. The lease needs only what those filesystems do provide:
an atomic ``link`` (create-if-absent), an atomic ``rename`` and an exclusive create.

A newcomer finds one of:
- no lease: it creates one (``link`` of a complete file: exactly one of several wins);
- a live lease: it stops at once (``RunDirBusy``, exit code 2) naming the holder;
- a lease whose holder is stopping after SIGTERM/SIGINT (it is saving a checkpoint): it waits,
  up to ``TRAINFORGE_LEASE_WAIT_S`` seconds, for the holder to release it, then resumes from the
  checkpoint the holder just wrote (a requeued job that started early);
- a stale lease: the holder's process is gone (on this host: its pid no longer runs; on another
  host: the lease was not renewed for ``TRAINFORGE_LEASE_TIMEOUT_S`` seconds by the wall clock):
  it takes the lease over with a warning. Several newcomers taking over one stale lease race for
  an exclusive marker named after that lease: one wins, the others re-read and see a live lease.

What it does not guarantee: a holder on another host is judged by comparing its renewal time
with this host's clock, so the hosts' clocks must agree to well within the timeout (NTP); a
holder that freezes for longer than the timeout (suspended, a hung filesystem) can have its
lease taken over, and notices at its next renewal (it then stops writing: ``LeaseLost``); and
the filesystem must provide atomic rename and exclusive create (NFSv3+, Lustre, GPFS, local
disks do; some FUSE and object-store mounts do not).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .atomic import TMP_MARK, boot_id, host_name, parse_tag, process_alive, process_start_ticks, process_tag
from ..errors import TrainforgeError

LEASE_FILE = "lease.json"
TAKEOVER_PREFIX = f".{LEASE_FILE}.takeover-"  # + the stale lease's token: the exclusive marker of its takeover
TIMEOUT_ENV = "TRAINFORGE_LEASE_TIMEOUT_S"
WAIT_ENV = "TRAINFORGE_LEASE_WAIT_S"
DEFAULT_TIMEOUT_S = 180.0  # well above NFS attribute caching (up to 60 s): a live lease never looks stale
DEFAULT_WAIT_S = 600.0  # how long a requeued job waits for a stopping holder to save and release
RENEWALS_PER_TIMEOUT = 6
POLL_S = 0.25  # how often the renewal thread looks at the stop flag, and a waiting newcomer at the lease


class OutputDirError(TrainforgeError, RuntimeError):
    """The output directory cannot be used for this run."""


class RunDirBusy(TrainforgeError, RuntimeError):
    """Another live process holds the run directory (or the lease settings are wrong)."""


class LeaseLost(TrainforgeError, RuntimeError):
    """This process's lease was taken over by another process: it must not write the run directory."""


@dataclass
class LeaseInfo:
    """What ``lease.json`` records."""

    host: str
    pid: int
    pid_start: int | None  # the process's start time (Linux clock ticks): a reused pid is not the holder
    boot_id: str
    started_at: float  # epoch seconds
    renewed_at: float
    timeout_s: float
    command: str
    cwd: str
    token: str  # unique to one holding
    state: str = "running"  # running | stopping (a stop signal came; it is saving and will release)

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started_at))
        return f"pid {self.pid} on host {self.host}, since {since}, command: {self.command}"

    @classmethod
    def parse(cls, text: str) -> "LeaseInfo":
        d = json.loads(text)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment variable ``name``."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise RunDirBusy(f"{name}={raw!r}: give a positive number of seconds (default {default:g})")
    return value


def read_lease(path: Path) -> LeaseInfo | None | str:
    """The lease at ``path``; None when there is none; a string saying why it cannot be read."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"unreadable ({e.strerror})"
    try:
        return LeaseInfo.parse(text)
    except (ValueError, TypeError, KeyError) as e:
        return f"damaged ({type(e).__name__}: {e})"


def _taker_gone(marker: Path, timeout_s: float) -> bool:
    """Whether the process that made the takeover ``marker`` (its token inside) is gone: on this host its pid no longer
    runs; else (another host's, or unreadable) the marker is older than the lease timeout."""
    try:
        owner = parse_tag(marker.read_text().strip())
    except OSError:
        owner = None
    if owner is not None and owner[0] == process_tag().rsplit("-", 2)[0]:
        return not process_alive(owner[1])
    return _age_s(marker) > timeout_s


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def stale_reason(info: LeaseInfo) -> str | None:
    """Why the holder of ``info`` is gone, or None while it may be alive."""
    if info.host == host_name() and info.boot_id == boot_id():
        if not process_alive(info.pid, info.pid_start):
            return f"its process {info.pid} no longer runs on this host"
        return None  # alive here: it holds the lease, however late its last renewal
    if info.host == host_name():
        return "this host has restarted since it took the lease"
    age = time.time() - info.renewed_at
    if age > info.timeout_s:
        return f"it was not renewed for {age:.0f}s (lease timeout {info.timeout_s:g}s), so its process on {info.host} is presumed dead"
    return None


class RunLease:
    """The lease on one run directory, held by this process while it writes there."""

    def __init__(
        self,
        run_dir: Path,
        timeout_s: float,
        stopping: Callable[[], bool] = lambda: False,
        info: Callable[[str], None] = print,
        warn: Callable[[str], None] = print,
    ):
        """``stopping``: whether a stop signal came (the lease then says so, for a waiting newcomer)."""
        self.dir, self.path = Path(run_dir), Path(run_dir) / LEASE_FILE
        self.timeout_s, self.renew_s = timeout_s, timeout_s / RENEWALS_PER_TIMEOUT
        self.stopping, self._info, self._warn = stopping, info, warn
        self.token = process_tag()
        self.lost = False
        self.held = False
        self._marker: Path | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        now = time.time()
        self.record = LeaseInfo(
            host=host_name(), pid=os.getpid(), pid_start=process_start_ticks(os.getpid()), boot_id=boot_id(),
            started_at=now, renewed_at=now, timeout_s=timeout_s, command=_command(), cwd=os.getcwd(), token=self.token,
        )

    # ------------------------------------------------------------ taking it

    def acquire(self, wait_s: float) -> None:
        """Take the lease; wait up to ``wait_s`` for a stopping holder; raise ``RunDirBusy`` for a live one."""
        waited_since: float | None = None
        last_note = 0.0
        while True:
            found = read_lease(self.path)
            if found is None:
                if self._create():
                    break
                continue  # another newcomer created it first: look at theirs
            if isinstance(found, str):  # a lease file nobody can read: stale once it is old
                if _age_s(self.path) > self.timeout_s and self._take_over(found, None):
                    self._warn(f"took over the run directory's lease {self.path}: it was {found} and older than {self.timeout_s:g}s")
                    break
                if _age_s(self.path) <= self.timeout_s:
                    raise RunDirBusy(
                        f"{self.dir} has a lease file that is {found}: {self.path}. If no other run uses this "
                        f"directory, delete that file (or wait {self.timeout_s:g}s for it to be taken over)"
                    )
                continue
            why = stale_reason(found)
            if why is not None:
                if self._take_over(found.token, found.renewed_at):
                    self._warn(f"took over the lease on {self.dir} from {found.describe()}: {why}")
                    break
                continue
            if found.state != "stopping":
                raise RunDirBusy(_busy_message(self.dir, found))
            now = time.monotonic()
            if waited_since is None:
                waited_since = now
                self._info(
                    f"{self.dir} is held by {found.describe()}; it is stopping after a signal (saving a checkpoint): "
                    f"waiting up to {wait_s:g}s for it to release the run directory ({WAIT_ENV})"
                )
                last_note = now
            elif now - waited_since > wait_s:
                raise RunDirBusy(
                    f"{self.dir} is still held after waiting {wait_s:g}s for it to finish stopping: {found.describe()}. "
                    f"Run again when it has exited, or raise {WAIT_ENV}"
                )
            elif now - last_note >= 30:
                self._info(f"still waiting for pid {found.pid} on {found.host} to release {self.dir} ({now - waited_since:.0f}s)")
                last_note = now
            time.sleep(POLL_S)
        self.held = True
        self._thread = threading.Thread(target=self._renew_loop, name="run-lease", daemon=True)
        self._thread.start()

    def _write_temp(self) -> Path:
        tmp = self.dir / f".{LEASE_FILE}{TMP_MARK}{process_tag()}"
        with open(tmp, "w") as f:
            f.write(json.dumps(asdict(self.record), indent=2))
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def _create(self) -> bool:
        """Create the lease if there is none: a hard link of a complete file fails if the name exists."""
        tmp = self._write_temp()
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return os.stat(tmp).st_nlink == 2  # NFS: a retried link reports EEXIST although it was made
        except OSError:  # no hard links on this filesystem: an exclusive create, then the content
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                f.write(tmp.read_text())
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def _take_over(self, stale_token: str | None, renewed_at: float | None) -> bool:
        """Replace a stale lease; of several processes taking over the same one, exactly one wins:
        the one that creates the marker named after that lease's token."""
        marker = self.dir / f"{TAKEOVER_PREFIX}{stale_token or 'unreadable'}"
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            if _taker_gone(marker, self.timeout_s):  # its creator died before finishing the takeover
                marker.unlink(missing_ok=True)
                return False
            time.sleep(POLL_S)
            return False
        os.write(fd, self.token.encode())
        os.close(fd)
        current = read_lease(self.path)
        unchanged = (
            isinstance(current, LeaseInfo) and current.token == stale_token and current.renewed_at == renewed_at
        ) or (stale_token is None and isinstance(current, str))
        if not unchanged:  # released, renewed or replaced meanwhile: judge it again
            marker.unlink(missing_ok=True)
            return False
        os.replace(self._write_temp(), self.path)
        self._marker = marker  # kept until release: a slower newcomer sees the takeover is done
        for old in self.dir.glob(f"{TAKEOVER_PREFIX}*"):  # markers of earlier leases, left by killed processes
            if old != marker:
                old.unlink(missing_ok=True)
        return True

    # ------------------------------------------------------------ holding it

    def _renew_loop(self) -> None:
        last = time.monotonic()
        failing = False
        while not self._done.wait(POLL_S):
            stopping = self.stopping()
            if stopping == (self.record.state == "stopping") and time.monotonic() - last < self.renew_s:
                continue
            try:
                self._renew(stopping)
                last, failing = time.monotonic(), False
            except OSError as e:  # a filesystem hiccup: retried at the next poll, reported once
                if not failing:
                    self._warn(f"renewing the lease {self.path} failed ({e}); retrying")
                failing = True
            if self.lost:
                return

    def _renew(self, stopping: bool) -> None:
        current = read_lease(self.path)
        if isinstance(current, str):  # unreadable just now (a filesystem hiccup): retried
            raise OSError(f"the lease file is {current}")
        if current is None or current.token != self.token:
            self.lost = True
            who = current.describe() if isinstance(current, LeaseInfo) else "nobody (the lease file is gone)"
            self._warn(
                f"the lease on {self.dir} was taken over and is now held by {who}; this process stops writing there "
                f"(it was not renewed for longer than {self.timeout_s:g}s: was this process suspended?)"
            )
            return
        self.record.renewed_at = time.time()
        self.record.state = "stopping" if stopping else "running"
        os.replace(self._write_temp(), self.path)

    def check(self) -> None:
        """Raise ``LeaseLost`` when another process took the lease over: nothing more may be written."""
        if self.lost:
            raise LeaseLost(
                f"another process took over {self.dir} (see {self.path}); this run stopped without writing more there"
            )

    def release(self) -> None:
        """Stop renewing and delete the lease (if it is still this process's)."""
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        if self.held and not self.lost:
            current = read_lease(self.path)
            if isinstance(current, LeaseInfo) and current.token == self.token:
                self.path.unlink(missing_ok=True)
        if self._marker is not None:
            self._marker.unlink(missing_ok=True)
        self.held = False


_HELD: dict[Path, RunLease] = {}


def check_writer(path: Path) -> None:
    """Raise ``LeaseLost`` when ``path`` lies in a run directory whose lease this process lost."""
    path = Path(path).resolve()
    for root, lease in _HELD.items():
        if path == root or root in path.parents:
            lease.check()


def _command() -> str:
    argv = list(sys.argv)
    if argv and argv[0].endswith(("__main__.py", "-c")):
        argv[0] = "python -m trainforge"
    elif argv:
        argv[0] = Path(argv[0]).name
    return " ".join([argv[0], *map(shlex.quote, argv[1:])]) if argv else "?"


def _busy_message(run_dir: Path, holder: LeaseInfo) -> str:
    renewed = time.strftime("%H:%M:%S", time.localtime(holder.renewed_at))
    return (
        f"{run_dir} is in use by another trainforge run: {holder.describe()} (lease {run_dir / LEASE_FILE}, "
        f"last renewed {renewed}). One run writes a run directory at a time: wait for it to finish, stop it "
        f"(SIGTERM saves a checkpoint; then run this command again to resume), or choose another --output. "
        + (
            "If that process is gone, the next launch takes over at once"
            if holder.host == host_name()
            else f"If that process is gone, its lease expires {holder.timeout_s:g}s after its last renewal"
        )
    )


RUN_MARKER = ".trainforge-run"
"""Left in a run directory when a run claims it: what tells a run directory from a user's folder."""
RUN_FILES = ("metrics.jsonl", "checkpoints")  # run directories written before the marker existed hold these


def probe_run_dir(out: Path) -> bool:
    """Create ``out`` if needed and check that files can be written in it; True when it already holds a run
    (a non-empty metrics.jsonl; an empty one is a run that failed in its setup).

    A folder that is neither empty nor a trainforge run directory is refused: a run would replace the
    user's files in it (a ``config.yaml``, a ``report.html``, ...)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        if not (out / RUN_MARKER).exists() and not any((out / name).exists() for name in RUN_FILES):
            # the lease and its temporaries and takeover markers (this process's own, or a killed one's) are no user's
            foreign = sorted(p.name for p in out.iterdir()
                             if p.name != LEASE_FILE and not p.name.startswith(f".{LEASE_FILE}") and TMP_MARK not in p.name)
            if foreign:
                shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
                raise OutputDirError(
                    f"{out} exists and is not a trainforge run directory (it holds {shown}); a run would overwrite "
                    "files there: choose a new --output (an empty or missing directory)"
                )
            (out / RUN_MARKER).write_text("a trainforge run directory\n")
        probe = out / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise unwritable_output(out, e) from None
    metrics = out / "metrics.jsonl"
    return metrics.exists() and metrics.stat().st_size > 0


def unwritable_output(out: Path, e: OSError) -> OutputDirError:
    """The error for an output directory that cannot be made or written, naming a file (or a dangling link) in its way."""
    dangling = next((p for p in (out, *out.parents) if p.is_symlink() and not p.exists()), None)
    if dangling is not None:
        what = "is" if dangling == out else f"is below {dangling}, which is"
        return OutputDirError(
            f"--output {out} {what} a symbolic link to a missing path ({os.readlink(dangling)}): create the directory "
            "it points to, remove the link, or give another --output"
        )
    blocked = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        what = "is a file" if blocked == out else f"is below {blocked}, which is a file"
        return OutputDirError(f"--output {out} {what}, not a directory: give a new or empty directory")
    return OutputDirError(f"cannot write to output directory {out}: {e.strerror}")


@contextlib.contextmanager
def hold_run_dir(
    run_dir: Path,
    ctx: Any = None,
    reporter: Any = None,
    stopping: Callable[[], bool] = lambda: False,
    max_wait_s: float | None = None,
) -> Iterator[RunLease | None]:
    """Hold the lease on ``run_dir`` for the block (under torchrun rank 0 holds it; every rank fails
    alike when it cannot). ``max_wait_s``: a cap on the wait for a stopping holder (the other ranks
    wait in a collective that has its own timeout)."""
    main = ctx is None or ctx.is_main
    lease: RunLease | None = None
    error: tuple[bool, str] | None = None  # (the directory cannot be written, message)
    created = not Path(run_dir).exists()  # made for the lease: removed again if the run leaves nothing in it
    if main:
        try:
            timeout, wait = env_seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S), env_seconds(WAIT_ENV, DEFAULT_WAIT_S)
            if max_wait_s is not None:
                wait = min(wait, max_wait_s)
            try:
                Path(run_dir).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise unwritable_output(Path(run_dir), e) from None
            lease = RunLease(
                run_dir, timeout, stopping,
                info=reporter.info if reporter is not None else print, warn=reporter.warn if reporter is not None else print,
            )
            lease.acquire(wait)
        except (RunDirBusy, OutputDirError) as e:
            error = (isinstance(e, OutputDirError), str(e))
    if ctx is not None and ctx.enabled:
        error = ctx.broadcast_object(error)
    if error is not None:
        raise (OutputDirError if error[0] else RunDirBusy)(error[1])
    key = Path(run_dir).resolve()
    if lease is not None:
        _HELD[key] = lease
    try:
        yield lease
    finally:
        if lease is not None:
            _HELD.pop(key, None)
            lease.release()
            if created:  # bad data or config failed before anything was written: leave no empty run directory
                with contextlib.suppress(OSError):
                    Path(run_dir).rmdir()
