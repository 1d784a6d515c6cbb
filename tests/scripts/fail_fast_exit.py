"""A one-rank gloo job (MASTER_ADDR/PORT from the test) that starts the fail-fast watch and ends.
An exit hook registered before the watch (so it runs after the watch's own) prints whether the
watch thread is still alive then: it must not be. A daemon thread that returns from a store call
into a finalizing interpreter aborts the process ("terminate called without an active
exception"), which turned finished runs into failures."""
import atexit
import datetime
import threading

import torch.distributed as dist

from lightning_mhc.distributed.fail_fast import FailFast


@atexit.register
def report() -> None:
    alive = [t.name for t in threading.enumerate() if t.name == "lightning_mhc-fail-fast" and t.is_alive()]
    print(f"watch alive at shutdown: {alive}", flush=True)


dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
FailFast(poll_s=0.01).start("rank 0")
FailFast(poll_s=0.01).start("rank 0")  # a second run in the same process (a second Trainer)
print(f"watches: {sum(t.name == 'lightning_mhc-fail-fast' for t in threading.enumerate())}", flush=True)
