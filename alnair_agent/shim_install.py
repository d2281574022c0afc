"""`alnair-agent install-shim DIR`: the DaemonSet's init container puts libalnair.so on the host atomically.

The library is written under a temporary name in DIR, flushed, then renamed over `DIR/libalnair.so` (rename(2) in
one folder is atomic): a container starting at that moment maps either the old file or the new one, never half a
file, and containers already running keep the old inode they mapped.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SHIM_NAME = "libalnair.so"


def packaged_shim() -> Path:
    """The libalnair.so built into the package (setup.py builds it into alnair_agent/lib/)."""
    return Path(__file__).resolve().parent / "lib" / SHIM_NAME


def install_shim(folder: str | os.PathLike[str], source: Path | None = None) -> int:
    src = packaged_shim() if source is None else source
    dest_dir = Path(folder)
    if not src.is_file():
        print(f"alnair-agent install-shim: {src} is missing (the package was built without the shim)", file=sys.stderr)
        return 1
    if not dest_dir.is_dir():
        print(f"alnair-agent install-shim: {dest_dir} is not a folder (mount the host's shim folder there)",
              file=sys.stderr)
        return 1
    tmp = dest_dir / f".{SHIM_NAME}.{os.getpid()}.tmp"
    try:
        with open(src, "rb") as r, open(tmp, "wb") as w:
            while chunk := r.read(1 << 20):
                w.write(chunk)
            w.flush()
            os.fsync(w.fileno())
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest_dir / SHIM_NAME)
        dir_fd = os.open(dest_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        print(f"alnair-agent install-shim: cannot install into {dest_dir}: {e}", file=sys.stderr)
        return 1
    print(f"installed {dest_dir / SHIM_NAME} ({(dest_dir / SHIM_NAME).stat().st_size} bytes)")
    return 0
