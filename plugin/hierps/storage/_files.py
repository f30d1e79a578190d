"""Small file-system helpers for durability: fsync of trees, atomic JSON replacement, full disks."""

from __future__ import annotations

import errno
import json
import os
import queue
import shutil
import threading
import uuid
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from hierps._faults import fault_point
from hierps.errors import CorruptStoreError, StoreFullError

__all__ = [
    "BackgroundThread",
    "Remover",
    "Skeletons",
    "all_closed",
    "append_all",
    "disk_full_as_error",
    "fsync_dir",
    "fsync_tree",
    "link_tree",
    "made_beside",
    "read_json_checked",
    "remove_stale_temp_dirs",
    "temp_dir_for",
    "write_json_atomic",
]

_RESTORE = (
    "Restore it from a backup; for a checkpoint manifest, moving it out of the store directory "
    "falls back to the checkpoint before it."
)
# errno values that mean "this file system has no room for the write": no space, over quota.
_FULL = (errno.ENOSPC, errno.EDQUOT)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path`` (files first, then their directories)."""
    for dirpath, _dirnames, filenames in os.walk(path, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def link_tree(src: Path, dst: Path) -> None:
    """Make ``dst`` (it must not exist) a tree of the directories of ``src`` and hard links to its
    files: no byte copied, and neither name's files change when the other goes (a tree written
    over is cut first, and a file with another name is unlinked then: ``_cut_files``). On an error
    (another file system: ``EXDEV``; a full disk) what was made of ``dst`` is removed and the error
    raised; ``src`` is never touched."""
    os.mkdir(dst)
    try:
        for folder, dirs, names in os.walk(src):
            into = dst / os.path.relpath(folder, src)
            for name in dirs:
                os.mkdir(into / name)
            for name in names:
                os.link(os.path.join(folder, name), into / name)
    except BaseException:
        shutil.rmtree(dst, ignore_errors=True)
        raise


class BackgroundThread:
    """The one background thread of a file-system helper, started at its first task; a forked child
    (whose parent's threads are gone) starts its own."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._pool: tuple[int, ThreadPoolExecutor] | None = None

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        if self._pool is None or self._pool[0] != os.getpid():
            self._pool = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix=self._name))
        return self._pool[1].submit(fn, *args)

    def stop(self) -> None:
        """Wait for the tasks submitted, and end the thread (the next :meth:`submit` starts another)."""
        pool, self._pool = self._pool, None
        if pool is not None and pool[0] == os.getpid():
            pool[1].shutdown(wait=True)


# The thread that encodes and writes a bulk write's runs while the next is read and merged.
_APPENDS = BackgroundThread("hierps-append")


def append_all(
    append: Callable[[np.ndarray, np.ndarray], None],
    runs: Iterable[tuple[np.ndarray, np.ndarray]],
    beside: bool = True,
) -> None:
    """``append(keys, rows)`` of every run of ``runs``, in order; ``beside``: each on a thread of its
    own while the next run is made (one append under way at a time: a writer that reads, merges and
    writes as much as it reads uses both). The writer is left to nothing else until its appends are
    done, also when ``runs`` raises. The runs' arrays must not change once made (each a new one)."""
    if not beside:
        for keys, rows in runs:
            append(keys, rows)
        return
    pending: Future[None] | None = None
    try:
        for keys, rows in runs:
            if pending is not None:
                pending.result()
            pending = _APPENDS.submit(append, keys, rows)
    except BaseException:
        if pending is not None:
            futures_wait([pending])  # the append under way ends before the caller aborts the writer
        raise
    if pending is not None:
        pending.result()


T = TypeVar("T")


def made_beside(items: Iterator[T]) -> Iterator[T]:
    """``items``, each made on a thread of their own one ahead of the one taken (a scan of one part
    beside the scans of others and the merge that takes them). What ``items`` raises is raised here;
    closed early, the thread stops after the item it is making and closes ``items`` itself."""
    ready: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)
    stop = threading.Event()

    def make() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        ready.put((True, item), timeout=0.05)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    break
            else:
                ready.put((False, None))
        except BaseException as e:  # handed to the taker, raised there
            ready.put((False, e))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=make, name="hierps-made-beside", daemon=True)
    thread.start()
    try:
        while True:
            more, item = ready.get()
            if not more:
                if item is not None:
                    raise item
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # let a put under way through, then wait for the thread's end
            with suppress(queue.Empty):
                ready.get(timeout=0.05)
        thread.join()


@contextmanager
def all_closed(items: Iterable[Iterator[Any]]) -> Iterator[None]:
    """Close each of ``items`` that closes (a generator; a scan :func:`made_beside`, whose thread has
    ended then) when the block ends, however it ends: no scan goes on after an error."""
    try:
        yield
    finally:
        for item in items:
            close = getattr(item, "close", None)
            if close is not None:
                close()


def _delete_others(folder: Path, mine: str) -> None:
    """Delete what is in ``folder`` but the entries named ``<mine>-...`` (left by processes that were killed)."""
    for p in folder.iterdir() if folder.is_dir() else []:
        if not p.name.startswith(f"{mine}-"):
            shutil.rmtree(p, ignore_errors=True)


class Remover:
    """Directories deleted in the background: each is renamed into ``trash`` at once (one rename: it
    is gone from where it was listed), then deleted there by a thread of its own.

    Deleting a segment's directory tree costs tens of milliseconds of file-system work where its
    rename costs tens of microseconds, and nearly none of it is CPU: the thread waits for the file
    system, not for the GIL, beside the caller. What a killed process left in ``trash`` goes at
    :meth:`empty`. A directory that cannot be renamed is deleted at once, as before.
    """

    def __init__(self, trash: Path) -> None:
        self.trash = trash
        self._prefix = uuid.uuid4().hex[:12]  # this remover's entries in trash
        self._count = 0
        self._lock = threading.Lock()
        self._pending: list[Future[None]] = []
        self._thread = BackgroundThread("hierps-remove")

    def remove(self, path: Path) -> None:
        """Delete the directory ``path`` (nothing if it is gone), in the background when it can."""
        with self._lock:
            self._count += 1
            target = self.trash / f"{self._prefix}-{self._count}"
            try:
                self.trash.mkdir(exist_ok=True)
                os.rename(path, target)
            except FileNotFoundError:
                if path.exists():  # the trash could not be made: delete it here
                    shutil.rmtree(path, ignore_errors=True)
                return
            except OSError:
                shutil.rmtree(path, ignore_errors=True)
                return
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._thread.submit(shutil.rmtree, target, True))

    def wait(self) -> None:
        """Block until every directory handed to :meth:`remove` so far is deleted."""
        with self._lock:
            pending, self._pending = self._pending, []
        futures_wait(pending)

    def empty(self) -> None:
        """:meth:`wait`, then delete what else is in ``trash`` (left there by a process that was killed)."""
        self.wait()
        _delete_others(self.trash, self._prefix)

    def close(self) -> None:
        """:meth:`wait`, and end the thread (a later :meth:`remove` starts another)."""
        self.wait()
        with self._lock:
            self._thread.stop()


class Skeletons:
    """Empty directory trees of one shape (``dirs``: relative paths, each with its parents), made ahead
    in ``spare`` by a thread of their own, so that a writer gets the directories of what it writes by
    one rename (:meth:`place`) where making them costs one ``mkdir`` each (0.2 ms on a quiet ext4
    here, a few ms under load): a segment has 8.

    The trees are numbered in the order :meth:`place` takes them, and asked for ``keep`` ahead: the
    thread makes them in that order, and :meth:`place` waits for its tree if the thread has not made
    it yet (at most one tree's ``mkdir`` calls), so which calls a run makes, and in which order around
    a checkpoint (:meth:`wait`), does not depend on timing. A tree that could not be made (a full
    disk) is not placed: the writer makes its directories and reports the error itself. What a
    killed process left in ``spare`` goes at :meth:`empty`.

    Trees of that shape that are done with (a retired segment's) come back through :meth:`recycle`:
    the thread cuts their files to their first byte (their space freed at once, but for a block; a
    file with a hard link elsewhere is unlinked instead, so that a backup made of links keeps its
    bytes) and :meth:`place` hands them out before any tree made ahead, files and all. Their writers
    write over them from the start (``_arrays._create``). Not cut to 0 bytes: on ext4 that makes the
    writer's ``close`` push the file's new pages to the device then and there (its ``auto_da_alloc``
    guard against the "truncate and rewrite" pattern; 0.04-0.1 ms a file here, on the thread that
    writes). So a store in its steady
    state, which retires about as many segments as it writes, neither makes nor deletes directories
    and files: on a file system that has deleted many files lately, making one costs more than
    writing a segment's rows (ext4 looks for an inode not deleted lately: 0.4-0.6 ms of system CPU
    a ``mkdir`` or file here, 14 of them a segment), and deleting one costs about a third of that.
    """

    def __init__(self, spare: Path, dirs: tuple[str, ...], keep: int = 16, hold: int = 64) -> None:
        self.spare, self._dirs, self._keep, self._hold = spare, dirs, keep, hold
        self._prefix = uuid.uuid4().hex[:12]  # this process's trees in spare
        self._cond = threading.Condition()
        self._asked = 0  # trees asked of the thread: numbers [0, asked)
        self._taken = 0  # trees placed or passed over: numbers [0, taken)
        self._made: dict[int, Path | None] = {}  # made and not yet taken (None: could not be made)
        # Trees given back, oldest first, each with the cutting of its files (True: cut).
        self._recycled: deque[tuple[Path, Future[bool]]] = deque()
        self._returned = 0  # trees given back so far (their names in spare)
        self._thread = BackgroundThread("hierps-skeletons")
        self.placed = 0  # trees placed so far
        self.reused = 0  # of them, trees given back

    def place(self, path: Path) -> bool:
        """Rename the next tree to ``path`` (its parent made if missing): a tree given back if any is
        held, else the next made ahead. False when it could not be made, cut or renamed: the caller
        makes the directories."""
        with self._cond:
            reused = self._recycled.popleft() if self._recycled else None
            if reused is None:
                if self._asked - self._taken <= self._keep // 2:
                    self._ask(self._keep - (self._asked - self._taken))
                k, self._taken = self._taken, self._taken + 1
                while k not in self._made:
                    self._cond.wait()
                tree = self._made.pop(k)
        if reused is not None:
            tree = reused[0] if reused[1].result() else None
        if tree is None:
            return False
        try:
            _rename_into(tree, path)  # a table's first segment: its directory is made first
        except OSError:
            shutil.rmtree(tree, ignore_errors=True)
            return False
        self.placed += 1
        self.reused += reused is not None
        return True

    def recycle(self, path: Path) -> bool:
        """Take back the tree at ``path`` (of this shape; the files in it are cut), to be placed
        again; False when ``hold`` trees are held already or it cannot be moved: the caller deletes it.
        (A merge retires its inputs together: more than a write-back takes at once.)"""
        with self._cond:
            if len(self._recycled) >= self._hold:
                return False
            target = self.spare / f"{self._prefix}-r{self._returned}"
            try:
                _rename_into(path, target)  # no tree made ahead yet: spare is made first
            except OSError:
                return False
            self._returned += 1
            self._recycled.append((target, self._thread.submit(_cut_files, target)))
            return True

    def _ask(self, count: int) -> None:
        """(Under the condition's lock.) Have the thread make the next ``count`` trees."""
        self._thread.submit(self._make, self._asked, count)
        self._asked += count

    def _make(self, first: int, count: int) -> None:
        failed = False  # e.g. a full disk: the writers make their directories, and say so
        for k in range(first, first + count):
            tree = None if failed else self.spare / f"{self._prefix}-{k}"
            try:
                if tree is not None:
                    try:
                        self.spare.mkdir(exist_ok=True)
                        os.mkdir(tree)
                        for rel in self._dirs:
                            os.makedirs(tree / rel, exist_ok=True)
                    except Exception:
                        shutil.rmtree(tree, ignore_errors=True)
                        tree, failed = None, True
            finally:
                with self._cond:  # a waiting place() gets its answer, made or not
                    self._made[k] = tree
                    self._cond.notify_all()

    def wait(self) -> None:
        """Block until every tree asked for is made (or could not be), and every tree given back cut."""
        with self._cond:
            while any(k not in self._made for k in range(self._taken, self._asked)):
                self._cond.wait()
            emptying = [f for _, f in self._recycled]
        futures_wait(emptying)

    def empty(self) -> None:
        """Delete what other processes left in ``spare`` (this one's trees stay ready)."""
        _delete_others(self.spare, self._prefix)

    def close(self) -> None:
        """End the thread and delete the trees not taken (a later :meth:`place` starts again)."""
        self._thread.stop()
        with self._cond:
            made, self._made = self._made, {}
            self._taken = self._asked  # the next tree asked for is numbered after them
            recycled, self._recycled = list(self._recycled), deque()
        for tree in [*made.values(), *(t for t, _ in recycled)]:
            if tree is not None:
                shutil.rmtree(tree, ignore_errors=True)


def _rename_into(src: Path, dst: Path) -> None:
    """``os.rename(src, dst)``, making ``dst``'s parent first where it is missing."""
    try:
        os.rename(src, dst)
    except FileNotFoundError:
        if not src.exists():
            raise
        os.makedirs(dst.parent, exist_ok=True)
        os.rename(src, dst)


def _cut_files(tree: Path) -> bool:
    """Cut every file under ``tree`` to its first byte (a file of at most one byte is left as it is);
    False (the tree deleted) when one cannot be. Their writers write over them (``_arrays._create``):
    every file a segment writes is longer than a byte, so none keeps a byte of the old.

    A file with another name elsewhere (a hard link: a backup of the store made by ``cp -al`` or
    ``rsync --link-dest``) is unlinked instead, so that the other name keeps its bytes; its writer
    makes it again."""
    try:
        for folder, _, names in os.walk(tree):
            for name in names:
                path = os.path.join(folder, name)
                info = os.stat(path)
                if info.st_nlink > 1:
                    os.unlink(path)
                elif info.st_size > 1:
                    os.truncate(path, 1)
    except OSError:
        shutil.rmtree(tree, ignore_errors=True)
        return False
    return True


def temp_dir_for(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place: ``.<name>.tmp-<pid>`` beside it."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def remove_stale_temp_dirs(parent: Path) -> list[Path]:
    """Remove the directories :func:`temp_dir_for` names under ``parent`` whose process is gone (a
    writer that was killed); those of live processes stay. Returns what was removed."""
    removed = []
    for p in parent.iterdir() if parent.is_dir() else []:
        pid = _temp_pid(p.name)
        if pid is not None and pid != os.getpid() and not _alive(pid) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _temp_pid(name: str) -> int | None:
    head, sep, pid = name.rpartition(".tmp-")
    return int(pid) if sep and head.startswith(".") and len(head) > 1 and pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _free_bytes(path: Path) -> int | None:
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return None


_AFTER_FULL = (
    "call checkpoint() again; the last checkpoint is intact and rows not yet written are still held in RAM."
)


@contextmanager
def disk_full_as_error(path: Path, what: str, needed: int, then: str = _AFTER_FULL) -> Iterator[None]:
    """Turn an ``ENOSPC`` / ``EDQUOT`` raised inside the block into :class:`StoreFullError`.

    ``what`` says what was being written (``"segment 12 of table 'user'"``), ``needed`` about how
    many bytes it takes; the message names ``path``, both numbers and what to do: free space, then
    ``then``.
    """
    try:
        yield
    except StoreFullError:
        raise
    except OSError as exc:
        if exc.errno not in _FULL:
            raise
        free = _free_bytes(Path(path))
        raise StoreFullError(
            f"{path}: no space left on the device while writing {what}: it needs about {needed} bytes, "
            f"{'an unknown number of' if free is None else free} bytes are free. Free space on that disk "
            f"(or copy the store to a bigger one) and {then}",
            str(path),
            needed,
        ) from exc


def write_json_atomic(path: Path, body: dict[str, Any]) -> None:
    """Write ``body`` to ``path`` so that readers see the old file or the whole new one.

    The body is stored with its CRC-32 so that a flipped byte is detected on read. On failure
    (e.g. :class:`StoreFullError`) the temporary file is removed and ``path`` is unchanged.
    """
    text = json.dumps(body, sort_keys=True, indent=1)
    doc = {"crc32": zlib.crc32(text.encode("utf-8")), "body": body}
    data = json.dumps(doc, sort_keys=True, indent=1).encode("utf-8")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with disk_full_as_error(path, f"the manifest {path.name}", len(data)):
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fault_point("json.before_replace")
    os.replace(tmp, path)
    fault_point("json.after_replace")
    fsync_dir(path.parent)


def read_json_checked(path: Path) -> dict[str, Any]:
    """The body written by :func:`write_json_atomic`; ``CorruptStoreError`` naming the file otherwise."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        body = doc["body"]
        crc = int(doc["crc32"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptStoreError(
            f"{path}: cannot be read as a hierps manifest ({exc}); the file is truncated or damaged. "
            f"{_RESTORE}"
        ) from exc
    text = json.dumps(body, sort_keys=True, indent=1)
    if zlib.crc32(text.encode("utf-8")) != crc:
        raise CorruptStoreError(f"{path}: checksum mismatch (the file was modified or damaged). {_RESTORE}")
    if not isinstance(body, dict):
        raise CorruptStoreError(f"{path}: expected a JSON object as body. Got {type(body).__name__} instead.")
    return body


# -- open files ----------------------------------------------------------------------------------
class OpenFiles:
    """Read-only descriptors of array files kept open between reads: at most ``capacity`` (the
    least recently used beyond that are closed), each closed by :meth:`forget` when its file is
    retired (deleted or rewritten), or by :meth:`close`.

    A descriptor in use by a read (between :meth:`acquire` and :meth:`release`) is closed only once
    released, so that no read ever meets a closed or reused descriptor. A file removed while open
    still reads as it was: an index pointing into it sees the rows it pointed at. Thread-safe.
    """

    def __init__(self, capacity: int = 512) -> None:
        self.capacity = capacity
        # Reentrant: a read abandoned with its files acquired (a lazy ``read_arrays`` left in a
        # reference cycle by an exception) releases them when the garbage collector finalizes it,
        # which may happen in any thread at any allocation, this lock's holder included.
        self._lock = threading.RLock()
        self._fds: OrderedDict[Path, int] = OrderedDict()
        self._pins: dict[int, int] = {}  # fd -> reads using it
        self._retired: set[int] = set()  # forgotten while in use: closed on the last release

    def acquire(self, path: Path) -> int:
        """A descriptor of ``path`` for reading, held until :meth:`release`; ``OSError`` if it cannot
        be opened."""
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead
                self._fds[path] = fd
                self._trim()
            else:
                self._fds.move_to_end(path)
            self._pins[fd] = self._pins.get(fd, 0) + 1
            return fd

    def release(self, fd: int) -> None:
        with self._lock:
            self._pins[fd] -= 1
            if self._pins[fd] == 0:
                del self._pins[fd]
                if fd in self._retired:
                    self._retired.discard(fd)
                    os.close(fd)

    def forget(self, paths: Iterable[Path]) -> None:
        """Close the descriptors of ``paths`` (now, or when the reads using them end)."""
        with self._lock:
            for path in paths:
                fd = self._fds.pop(path, None)
                if fd is not None:
                    self._retire(fd)

    def forget_under(self, root: Path) -> None:
        """Close the descriptors of every file below the directory ``root``."""
        # Compared as strings (pathlib's is_relative_to costs ~40x more): a store keeps hundreds of
        # files open, and every segment a compaction retires asks.
        top = os.fspath(root)
        under = top.rstrip(os.sep) + os.sep
        with self._lock:
            paths = [p for p in self._fds if (s := os.fspath(p)).startswith(under) or s == top]
        self.forget(paths)

    def close(self) -> None:
        self.forget(list(self._fds))

    def __len__(self) -> int:
        return len(self._fds)

    def _retire(self, fd: int) -> None:
        if fd in self._pins:
            self._retired.add(fd)
        else:
            os.close(fd)

    def _trim(self) -> None:
        while len(self._fds) > self.capacity:
            self._retire(self._fds.popitem(last=False)[1])
