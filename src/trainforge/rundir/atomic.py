"""Atomic writes with per-process temporary names: checkpoints, ``final/``, the token cache, reports.

Everything shared on disk is written under a hidden temporary name that only this process
uses (``.NAME.tmp-HOST-PID-RANDOM``), flushed, and renamed into place. Two processes writing
the same target never touch each other's temporaries; readers see the old or the new
version, never half of one. A temporary left by a process that died is recognized by its
name (``process_alive``) or by its age (both in ``temp_owner_gone``) and removed by whoever
cleans up (``remove_stale_temps``).

Two ways to put a directory in place: ``atomic_write_dir`` replaces the target (a checkpoint, an
export); ``publish_dir`` publishes it once (a cache entry: the first complete one is kept).
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

TMP_MARK = ".tmp-"  # hidden temporaries are ".NAME.tmp-TAG"
OLD_MARK = ".old-"  # a complete target parked while being replaced: ".NAME.old-TAG"


@cache
def host_name() -> str:
    """This machine's host name, as lease files and temporary names record it."""
    return socket.gethostname() or "localhost"


@cache
def boot_id() -> str:
    """An id of this boot of this machine (Linux), so a pid is compared only within one boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, Linux), to tell it from a later process
    that got the same pid; None where /proc is missing or the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime; the name may hold spaces
    except (IndexError, ValueError):
        return None


def process_alive(pid: int, start_ticks: int | None = None) -> bool:
    """Whether process ``pid`` of this machine still runs (and is the one that started at ``start_ticks``)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by another user
    if start_ticks is not None:
        now = process_start_ticks(pid)
        if now is not None and now != start_ticks:
            return False  # the pid was reused by another process
    return True


def _safe_host() -> str:
    return "".join(c if c.isalnum() else "_" for c in host_name())


def process_tag() -> str:
    """``HOST-PID-RANDOM``: unique to this process (and this call), safe in a file name."""
    return f"{_safe_host()}-{os.getpid()}-{secrets.token_hex(3)}"


def parse_tag(tag: str) -> tuple[str, int] | None:
    """(host, pid) from a tag ``process_tag`` made; None for another name."""
    parts = tag.rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def staging_dir(target: Path, tag: str | None = None) -> Path:
    """A hidden temporary directory beside ``target`` for this process to fill (``tag``: a name all
    processes of one job agree on, when several write into one directory)."""
    target = Path(target)
    return target.parent / f".{target.name}{TMP_MARK}{tag or process_tag()}"


def temp_owner_gone(path: Path, stale_after_s: float) -> bool:
    """Whether the temporary ``path`` (named by ``staging_dir``, or a parked ``.NAME.old-TAG``) belongs
    to a writer that is gone: its process on this host no longer runs, or (another host's, or a name
    without a tag) nothing in it changed for ``stale_after_s`` seconds."""
    name = Path(path).name
    mark = TMP_MARK if TMP_MARK in name else OLD_MARK if OLD_MARK in name else None
    if mark is None and not name.endswith((".tmp", ".old")):
        return False  # not a temporary
    owner = parse_tag(name.rsplit(mark, 1)[1]) if mark else None
    if owner is not None and owner[0] == _safe_host():
        return not process_alive(owner[1])
    return time.time() - newest_mtime(Path(path)) > stale_after_s


def remove_stale_temps(directory: Path, stale_after_s: float) -> list[str]:
    """Delete the hidden temporaries in ``directory`` whose writers are gone (``temp_owner_gone``);
    returns their names. Several processes may clean one directory at once."""
    removed: list[str] = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return removed
    for p in entries:
        if p.name.startswith(".") and temp_owner_gone(p, stale_after_s):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


def newest_mtime(path: Path) -> float:
    """The newest modification time of ``path`` and everything under it (0 when it is gone)."""
    newest = 0.0
    try:
        newest = path.stat().st_mtime
        for p in path.rglob("*"):
            try:
                newest = max(newest, p.stat().st_mtime)
            except OSError:
                pass
    except OSError:
        pass
    return newest


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
    fsync_dir(path)


def parked_name(target: Path) -> Path:
    """The hidden name ``target`` is moved aside to while it is replaced: ``.NAME.old-TAG``."""
    target = Path(target)
    return target.parent / f".{target.name}{OLD_MARK}{process_tag()}"


def _staged(target: Path, write: Callable[[Path], None], staging: Path | None) -> Path:
    """Run ``write(tmp_dir)`` in a new per-process temporary directory beside ``target`` and flush
    everything; the temporary is removed when ``write`` fails."""
    tmp = Path(staging) if staging is not None else staging_dir(target)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def atomic_write_dir(target: Path, write: Callable[[Path], None], staging: Path | None = None) -> Path:
    """Run ``write(tmp_dir)`` in a per-process temporary directory, flush everything, then rename
    it to ``target``.

    An existing ``target`` is replaced only after the new one is complete (it is parked as a
    hidden ``.NAME.old-TAG`` for the two renames; ``checkpoint.recover_hidden`` puts it back
    after a crash). ``staging``: the temporary directory to use (it must not exist yet).
    """
    target = Path(target)
    tmp = _staged(target, write, staging)
    try:
        if target.exists():
            old = parked_name(target)
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old)
        else:
            tmp.rename(target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def publish_dir(
    target: Path, write: Callable[[Path], None], complete: Callable[[Path], bool], staging: Path | None = None
) -> bool:
    """Publish a directory once: run ``write(tmp_dir)`` in a per-process temporary directory, flush
    everything, and rename it to ``target`` unless a complete ``target`` (``complete(target)``) is there.

    For content that is the same whoever writes it (a cache entry named by what it holds): of
    several processes publishing one target, the first complete one wins and is never replaced;
    the others drop their copy. An incomplete ``target`` (damaged: a hand copy) is parked as
    ``.NAME.old-TAG`` and replaced; a complete one that lands between the check and the parking is
    put back and kept. Returns True when this process's directory was published, False when
    another's complete one was kept.
    """
    target = Path(target)
    tmp = _staged(target, write, staging)
    try:
        published = _rename_once(tmp, target, complete)
        if published:
            fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not published:
        shutil.rmtree(tmp, ignore_errors=True)
    return published


def _taken(e: OSError, target: Path, complete: Callable[[Path], bool]) -> bool:
    """A rename onto ``target`` failed because another process's complete directory is there."""
    return e.errno in (errno.ENOTEMPTY, errno.EEXIST) and complete(target)


def _rename_once(tmp: Path, target: Path, complete: Callable[[Path], bool]) -> bool:
    if complete(target):  # another process finished while this one wrote
        return False
    if target.exists():  # incomplete: damaged, replaced
        aside = parked_name(target)
        try:
            target.rename(aside)
        except FileNotFoundError:
            pass  # another process moved it first
        else:
            if complete(aside):  # a complete one landed after the check: it stays
                try:
                    aside.rename(target)
                except OSError as e:
                    if not _taken(e, target, complete):
                        raise
                    shutil.rmtree(aside, ignore_errors=True)
                return False
            shutil.rmtree(aside, ignore_errors=True)
    try:
        tmp.rename(target)
    except OSError as e:  # ENOTEMPTY / EEXIST: another process's complete directory got there first
        if not _taken(e, target, complete):
            raise
        return False
    return True


def atomic_write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a per-process temporary file and an atomic replace:
    concurrent writers never mix their bytes, readers never see half a file."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """``atomic_write_text`` for bytes."""
    path = Path(path)
    tmp = path.parent / f".{path.name}{TMP_MARK}{process_tag()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def publish_new_file(target: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp_file)`` on a per-process temporary name beside ``target``, flush it, and publish it
    under ``target`` only if nothing is there (a hard link fails on an existing name, where a rename would
    replace it): ``FileExistsError`` then, and the temporary is removed either way."""
    target = Path(target)
    tmp = target.parent / f".{target.name}{TMP_MARK}{process_tag()}"
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        try:
            os.link(tmp, target)  # atomic and never clobbers: readers see no file or the whole file
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links: a rename, after a last check
            if target.exists():
                raise FileExistsError(errno.EEXIST, "file exists", str(target)) from None
            os.replace(tmp, target)
        fsync_dir(target.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return target
