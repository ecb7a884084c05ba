"""One process of a multi-process PreemptionGuard check (tests/multiprocess_util.py launches it):
`python mp_guard_worker.py SIGNAL`. Every process runs the same loop of short "steps"; process 1
alone sends itself SIGNAL after step 3. Prints one JSON line: the step each process stopped at."""
import json
import os
import signal
import sys
import time

from jaxrl_llm import sharding

sharding.initialize()

import jax  # noqa: E402

from jaxrl_llm.bookkeeping.preemption import PreemptionGuard, jax_preemption_service_active  # noqa: E402


def main() -> None:
    sig = getattr(signal, sys.argv[1])
    stopped = None
    with PreemptionGuard() as guard:
        for step in range(1, 200):
            time.sleep(0.05)  # short steps: shorter than jax's notice latency (its notifier polls each second)
            if jax.process_index() == 1 and step == 3:
                os.kill(os.getpid(), sig)
            if guard.stop_requested(step):
                stopped = step
                break
    print(json.dumps({"process": jax.process_index(), "stopped": stopped, "reason": guard.reason,
                      "jax_service": jax_preemption_service_active()}))


if __name__ == "__main__":
    main()
