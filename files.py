"""Files and directories a command writes: output paths checked before any work, permission bits
no looser than the sources', the temporary names of atomic writes and the clean-up of killed ones,
and a file's checksum."""
import os
import platform
from pathlib import Path

from rules import UserError


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


OUTPUT_TIME = "%Y-%m-%d_%H-%M-%S-%f"  # a new output dir's name: the time to the microsecond, as configs/config.yaml's run dirs


def default_output(name: str, file: str = "") -> str:
    """A Hydra command's output when not told one (its schema's default): a new directory per call,
    outputs/<name>/<time>/ (then `file` in it), as training runs get outputs/runs/<time>/, so that no call
    replaces an earlier call's files; the newest directory is the latest call's (`ls outputs/<name> | tail -1`).
    Written as Hydra's `${now:...}`: its value is cached in the composed config, so every read of the key in
    one call gives the same time, and each composition a new one."""
    return f"outputs/{name}/${{now:{OUTPUT_TIME}}}" + (f"/{file}" if file else "")


def new_output_dir(parent) -> Path:
    """The same for a command that parses its own options (argparse): `parent`/<time>, the time now."""
    from datetime import datetime

    return Path(parent) / datetime.now().strftime(OUTPUT_TIME)


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
