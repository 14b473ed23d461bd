"""Secret files (`RFORK_*_FILE`, read by the planner's settings and by loaders and seeds): one that any
user of the machine can read is said, with what to change.

Not refused: a mounted Compose or Kubernetes secret is world-readable unless its mode is set, and a
planner or loader that would not start is worse than one that says, on every start, what to fix.
Stdlib only: rfork imports it at start-up.
"""

from __future__ import annotations

import logging
import os
import stat

log = logging.getLogger(__name__)


def warn_if_world_readable(path: str, variable: str) -> bool:
    """Log a warning (and return True) when others may read the secret file `path` that `variable`
    names; False for a private file or one that cannot be stat'ed (reading it says why)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    if not mode & stat.S_IROTH:
        return False
    log.warning(
        "%s=%s is readable by every user of this machine (mode %o): chmod 600 it, or mount the secret "
        "with mode 0400 (Kubernetes: defaultMode: 0400)",
        variable, path, stat.S_IMODE(mode),
    )
    return True
