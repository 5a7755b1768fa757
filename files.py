"""Files and directories a command writes: output paths checked before any work, permission bits
no looser than the sources', the temporary names of atomic writes and the clean-up of killed ones,
a file's checksum, and a run dir that a refused command made and may remove again."""
import os
import platform
import time
from pathlib import Path

from rules import UserError

STARTED = time.time()  # this process's start, as near as an import gets: what it created is newer


def check_output_dir(path, key: str) -> Path:
    """A directory a command will write into (made if absent), checked before any work: one line if
    it is a file or a link to nothing, or if nothing can be made where it is or would be (read-only,
    another user's, /proc)."""
    p = Path(path).expanduser()
    if p.is_symlink() and not p.exists():
        raise UserError(f"{key}={path} is a symbolic link to nothing: name a directory")
    if p.exists() and not p.is_dir():
        raise UserError(f"{key}={path} is a file: name a directory")
    check_can_write(p, key, path)
    return p


def check_output_file(path, key: str) -> Path:
    """A file a command will write (or replace), checked before any work: one line if it is a
    directory, a symbolic link (writing would change whatever it points to) or in a place where
    nothing can be written."""
    p = Path(path).expanduser()
    if p.is_symlink():
        raise UserError(f"{key}={path} is a symbolic link: writing it would change the file it points to; "
                        "name the file itself")
    if p.is_dir():
        raise UserError(f"{key}={path} is a directory: name a file")
    check_can_write(p.parent, key, path)
    return p


def check_can_write(p: Path, key: str, given):
    """Try it: make and remove an empty directory in `p`, or in its nearest existing ancestor. Read-only
    places, another user's directory and /proc (where os.access says yes to root) all fail here."""
    import tempfile

    place = next(a for a in (p, *p.parents) if a.exists() or a.is_symlink())
    if not place.is_dir():
        raise UserError(f"{key}={given}: {place} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".attnlab-write-test-", dir=place))
    except OSError as e:
        raise UserError(f"{key}={given}: nothing can be written in {place} ({e.strerror}): name a directory "
                        "you can write") from None


def file_digest(file) -> str:
    """sha256 of a file's bytes (hex), read in pieces; an unreadable file is one line."""
    import hashlib

    h = hashlib.sha256()
    try:
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError as e:
        raise UserError(f"cannot read {file}: {e.strerror or e} (check its permissions)") from None
    return h.hexdigest()


def umask() -> int:
    """The process's umask, read without changing it (os.umask can only set it, and setting it
    even briefly races with other threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o077)  # not Linux: the strict mask for the instant it takes to read it
    os.umask(mask)
    return mask


def private_mode(sources=()) -> int:
    """Permission bits for files derived from `sources` (token files, checkpoints): no more
    readable than any source file and the umask allow; the owner keeps read and write."""
    mode = 0o666 & ~umask()
    for src in sources:
        mode &= os.stat(src).st_mode & 0o666
    return mode | 0o600


def dir_mode(file_mode: int) -> int:
    """The directory mode matching a file mode: searchable wherever readable."""
    return file_mode | ((file_mode & 0o444) >> 2) | 0o700


def remove_stale_temps(directory, alive_only=True):
    """Delete what killed writes left in `directory`: entries named `.NAME.tmp-PID` (files or
    dirs). With alive_only, entries of a process still running on this machine are kept (another
    process may be writing them); else every one goes (the caller holds the directory's lock)."""
    import shutil

    for p in Path(directory).glob(".*.tmp-*"):
        host, _, pid = p.name.rsplit(".tmp-", 1)[1].rpartition("-")  # .NAME.tmp-PID or .NAME.tmp-HOST-PID
        if alive_only and (host not in ("", platform.node()) or (pid.isdigit() and pid_alive(int(pid)))):
            continue  # another machine's (shared disk) or a live process's write
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def temp_suffix() -> str:
    """The tail of a temporary name in a directory other machines may share: host and pid."""
    return f".tmp-{platform.node()}-{os.getpid()}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def new_run_dir(out_dir: Path) -> bool:
    """True if the run dir is absent, or empty and made since this process started (Hydra makes a
    command's run dir before the command runs): a refused run may then remove it again."""
    try:
        return not any(out_dir.iterdir()) and out_dir.stat().st_mtime >= STARTED
    except FileNotFoundError:
        return True
    except OSError:
        return False


def remove_new_run_dir(out_dir: Path, locked: bool = False):
    """Undo a refused run's new dir: its lock file if this process holds the lock (`locked`; another
    process's lock stays, and so then does the dir), the dir, then each parent below the working
    directory that is left empty (Hydra's outputs/runs/ of a first run). Never the working directory
    or one above it."""
    run_dir, here = out_dir.resolve(), Path.cwd().resolve()
    if run_dir == here or run_dir in here.parents:
        return
    if locked:
        (out_dir / ".lock").unlink(missing_ok=True)
    for d in [run_dir] + [p for p in run_dir.parents if here in p.parents]:
        try:
            d.rmdir()  # only ever an empty one
        except OSError:
            break
