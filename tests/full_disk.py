"""A file the operating system stops growing, as a full disk, a quota or a failing device does: for tests of what a
save does when the write itself fails (torch.save turns that OSError into a RuntimeError of its own)."""

from __future__ import annotations

import errno
import io
import os


class FullDisk(io.FileIO):
    """A file opened for writing whose writes fail with ``failure`` (``ENOSPC`` by default) once it would hold more
    than ``room`` bytes; every write after the first that fails fails too, as on a disk that filled."""

    def __init__(self, file: str | os.PathLike | int, room: int, failure: int = errno.ENOSPC) -> None:
        super().__init__(file, "w")
        self.room, self.failure = room, failure

    def write(self, data) -> int:
        if self.tell() + len(data) > self.room:
            raise OSError(self.failure, os.strerror(self.failure))
        return super().write(data)
