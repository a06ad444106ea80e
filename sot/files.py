"""Files written whole or not at all."""
from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Callable


def replace_file(path: str | Path, write: Callable[[Path], None], mode: int | None = 0o644) -> None:
    """Write ``path`` whole or not at all: ``write(part)`` fills a temporary file beside it
    (a name of its own, so two writers never share one), which is then renamed over ``path``
    (over the file a symbolic link names, the link kept); a writer stopped midway leaves the
    previous file. ``mode``: the file's permissions
    (``None``: its owner's alone, for files that hold users' data)."""
    path = Path(os.path.realpath(path))  # (through a symbolic link: the file it names is replaced, the link kept)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "a folder, not a file: name a file in it", str(path))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    except OSError as exc:  # (named by the file asked for, not by the temporary one)
        raise OSError(exc.errno, f"cannot write there: {exc.strerror or exc}", str(path)) from None
    os.close(fd)
    part = Path(name)
    try:
        write(part)
        if mode is not None:
            part.chmod(mode)
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)


def write_output(path: str | Path, write: Callable[[Path], None]) -> None:
    """An output file the user named, written whole or not at all (:func:`replace_file`; a
    run stopped midway leaves the earlier file, not half of a new one); a path that is not a
    regular file (``/dev/stdout``, a pipe) is written as it is."""
    target = Path(path)
    if target.exists() and not target.is_file():
        write(target)
    else:
        replace_file(target, write)
