"""Writing files: safetensors saved with the umask's permissions, and a full disk or a file-size
limit reported as an OSError that names what was being written (not safetensors' SafetensorError,
and not a bare "[Errno 27] File too large" that names nothing)."""
from __future__ import annotations

import errno
import os
import re
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import save_file

OUT_OF_SPACE = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "the file-size limit (ulimit -f) was hit",
}


class OutOfSpaceError(OSError):
    """A write failed for want of space; the message names the file or folder."""


def save_tensors(tensors: dict, path: Path, metadata: dict | None = None) -> None:
    """safetensors' save_file, readable as the umask says (safetensors itself writes 0600)."""
    with out_of_space_names(path):
        try:
            save_file(tensors, str(path), metadata=metadata)
        except SafetensorError as err:  # an I/O failure arrives as "... (os error 28)"
            code = re.search(r"os error (\d+)", str(err))
            if code is None:
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1)))) from err
    os.chmod(path, 0o666 & ~current_umask())


@contextmanager
def out_of_space_names(target: Path, what: str = "cannot write"):
    """Turn ENOSPC / EDQUOT / EFBIG inside the block into an OutOfSpaceError naming `target`;
    an error already naming its file passes through."""
    try:
        yield
    except OutOfSpaceError:
        raise
    except OSError as err:
        if err.errno not in OUT_OF_SPACE:
            raise
        short = OutOfSpaceError(f"{what} {target}: {OUT_OF_SPACE[err.errno]} ({err.strerror})")
        short.errno = err.errno
        raise short from err


def os_error(err: OSError, message: str) -> OSError:
    """An OSError of err's kind and errno whose text is `message` alone (no "[Errno N]" prefix)."""
    new = type(err)(message)
    new.errno = err.errno  # (a strerror set too would make str() print "[Errno N] strerror" instead)
    return new


def current_umask() -> int:
    mask = os.umask(0o022)  # reading it means setting it: put it straight back
    os.umask(mask)
    return mask
