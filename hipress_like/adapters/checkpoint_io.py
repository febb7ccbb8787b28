"""Checkpoint files that are either whole or refused: write-rename with a footer.

A checkpoint written while its writer dies (a rank killed, a host losing
power, a full disk) must never be taken for a good one, and must never
replace the last good one. Two classic mechanisms give that (the pattern of
SQLite's and etcd's snapshot files, and of ``torch.distributed.checkpoint``'s
rename-on-commit):

1. **Write aside, then rename.** The bytes go to a temporary file in the
   same directory (``<name>.tmp-<pid>``), are flushed and ``fsync``-ed, and
   the file is renamed over ``path`` with ``os.replace``, which POSIX makes
   atomic within one file system; the directory is then ``fsync``-ed so the
   rename itself survives a crash. A writer killed before the rename leaves
   ``path`` as it was (the old checkpoint) plus a stray temporary file.
2. **A footer that says what a whole file is.** After the payload comes a
   fixed 56-byte footer: ``MAGIC`` (8 bytes), the payload length (8 bytes,
   little endian), the payload's SHA-256 (32 bytes), ``END`` (8 bytes).
   ``read_verified`` refuses a file whose footer is missing, whose length
   disagrees with the file's size (cut short, or bytes appended), or whose
   hash disagrees (a flipped bit), naming the file and what is wrong. So a
   partial file copied by hand, a temporary file of a dead writer, or a
   file truncated by a full disk is detected, not loaded.

The payload is opaque bytes here; ``adapters/torch/checkpoints.py`` fills
it with ``torch.save`` output and reads it back with
``torch.load(weights_only=True)``, so nothing in it is unpickled as
arbitrary objects.
"""
from __future__ import annotations

import hashlib
import os
import struct
from typing import Callable, Optional

from ..errors import HipressError

__all__ = ["MAGIC", "END", "FOOTER", "CheckpointError", "write_atomic", "read_verified",
           "temp_path"]

MAGIC = b"HPCKPT\x00\x01"  # the last byte is the footer's version
END = b"\x00TPKCPH\n"
_FMT = "<8sQ32s8s"
FOOTER = struct.calcsize(_FMT)  # 56 bytes
_CHUNK = 1 << 20  # write (and report progress) a MiB at a time


class CheckpointError(HipressError, ValueError):
    """A checkpoint file is incomplete, corrupted or not a checkpoint."""


def temp_path(path: str) -> str:
    """Where ``write_atomic`` stages ``path`` (same directory, so the rename is atomic)."""
    d, name = os.path.split(os.path.abspath(path))
    return os.path.join(d, f".{name}.tmp-{os.getpid()}")


def write_atomic(path: str, data: bytes, *,
                 progress: Optional[Callable[[int, int], None]] = None) -> None:
    """Write ``data`` and its footer to ``path`` so that ``path`` is never half-written.

    1. write ``data`` to ``temp_path(path)`` a MiB at a time (calling
       ``progress(written, total)`` after each), then the footer;
    2. flush and ``fsync`` the temporary file;
    3. ``os.replace`` it over ``path`` (atomic), then ``fsync`` the directory.

    Args:
        path: the checkpoint file; its directory must exist.
        data: the payload.
        progress: called as ``progress(bytes_written, total_bytes)`` after
            every chunk (long saves show progress; tests use it to kill a
            writer mid-save).

    Raises:
        OSError: the directory is not writable, the disk is full, ...; the
            temporary file is removed and ``path`` is left as it was.
    """
    tmp = temp_path(path)
    view = memoryview(data)
    footer = struct.pack(_FMT, MAGIC, len(view), hashlib.sha256(view).digest(), END)
    try:
        with open(tmp, "wb") as f:
            for at in range(0, len(view), _CHUNK):
                f.write(view[at:at + _CHUNK])
                if progress is not None:
                    progress(min(at + _CHUNK, len(view)), len(view))
            f.write(footer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _fsync_dir(d: str) -> None:
    """Make a rename in ``d`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_verified(path: str) -> bytes:
    """The payload of a file ``write_atomic`` wrote, after checking its footer.

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointError: the file is shorter than a footer, has no footer
            (cut short while being written, or not written by
            ``write_atomic``), its length field disagrees with its size, or
            its SHA-256 disagrees with its bytes; the message names the file.
    """
    with open(path, "rb") as f:
        blob = f.read()
    fix = ("restore it from a good copy, or load the previous checkpoint; a file named "
           "'.<name>.tmp-<pid>' is what a writer killed mid-save leaves and can be deleted")
    if len(blob) < FOOTER:
        raise CheckpointError(f"checkpoint {path} is incomplete: {len(blob)} bytes, shorter "
                              f"than its {FOOTER}-byte footer (cut short while being "
                              f"written?); {fix}")
    magic, length, digest, end = struct.unpack(_FMT, blob[-FOOTER:])
    if magic != MAGIC or end != END:
        raise CheckpointError(f"checkpoint {path} is incomplete or not a hipress-like "
                              f"checkpoint: its last {FOOTER} bytes are not the footer "
                              f"(expected it to end with {END!r}, found {blob[-8:]!r}; a "
                              f"file cut short while being written ends mid-payload); {fix}")
    if length != len(blob) - FOOTER:
        raise CheckpointError(f"checkpoint {path} is damaged: its footer says "
                              f"{length} payload bytes, the file holds {len(blob) - FOOTER}; "
                              f"{fix}")
    payload = memoryview(blob)[:length]
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"checkpoint {path} is corrupted: the SHA-256 of its "
                              f"{length} payload bytes differs from the one in its footer "
                              f"(a changed byte); {fix}")
    return bytes(payload)
