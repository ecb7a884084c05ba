"""Array type aliases shared across packages (a leaf module: it imports only jax and numpy)."""
from __future__ import annotations

import jax
import numpy as np

# Values that may be a device array or a host (numpy) copy: rollout metadata kept on the host, the
# paged engine's results (built on the host), inputs a jitted program accepts either way.
HostOrDevice = jax.Array | np.ndarray
