"""The only package that calls torch.distributed: process-group setup, every collective, the comm
ledger that counts them, and the failure guard.

- ledger.py: `CommLedger` (op, dtype, elements, bytes per step), the process-wide `ledger`, one
  ledger per engine (`recording`, [Note: one comm ledger per engine]), the node layout for links;
- collectives.py: all_reduce, reduce, broadcast, all_gather_into_tensor, reduce_scatter_tensor,
  all_to_all_single,
  barrier, `Pending` (an async collective);
- lifecycle.py: init_distributed, rank queries, process groups, `PeerGone`, and the exit drain
  ([Note: leaving nothing for interpreter shutdown]);
- guard.py: `on_every_rank` and `PeerFailed`: an error on one rank is raised on every rank.

Launch recipe (what `zerodp run` does for you):
    torchrun --standalone --nproc-per-node 2 train.py   # then zerodp.init_distributed() in train.py
"""

from zerodp.comm.collectives import (
    Pending,
    all_gather_into_tensor,
    all_gather_rows,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    free_after_wait,
    reduce,
    reduce_scatter_tensor,
)
from zerodp.comm.guard import PeerFailed, barrier_naming_missing_ranks, gather_messages, on_every_rank
# `ledger` below is the process-wide CommLedger, which replaces the submodule of the same name as this
# package's attribute (`comm.ledger.current` as before); the module is `zerodp.comm.ledger` in sys.modules,
# so `from zerodp.comm.ledger import X` still reaches it.
from zerodp.comm.ledger import (
    INTER_NODE,
    INTRA_NODE,
    CommLedger,
    CommRecord,
    active_ledger,
    comm_report,
    end_init,
    end_step,
    ledger,
    link_of,
    outside_step,
    records_to_own_ledger,
    recording,
    set_node_layout,
)
from zerodp.comm.lifecycle import (
    DEFAULT_TIMEOUT_S,
    DRAIN_TIMEOUT_S,
    PeerGone,
    backend,
    collective_timeout,
    default_backend,
    device_for_backend,
    drain_pending,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
    new_group,
    pending_collectives,
    set_simulated_device,
    settle_backend_threads,
    settled_collectives,
    simulated,
)

__all__ = [
    "DEFAULT_TIMEOUT_S", "DRAIN_TIMEOUT_S", "INTER_NODE", "INTRA_NODE", "CommLedger", "CommRecord", "PeerFailed",
    "PeerGone", "Pending", "active_ledger", "all_gather_into_tensor", "all_gather_rows", "all_reduce", "all_to_all_single", "backend",
    "barrier", "barrier_naming_missing_ranks", "broadcast", "collective_timeout", "comm_report", "default_backend",
    "device_for_backend", "drain_pending", "end_init", "end_step", "free_after_wait", "gather_messages", "get_rank", "get_world_size",
    "init_distributed", "is_initialized", "ledger", "link_of", "new_group", "on_every_rank", "outside_step",
    "pending_collectives", "records_to_own_ledger", "recording", "reduce", "reduce_scatter_tensor",
    "set_node_layout", "set_simulated_device", "settle_backend_threads", "settled_collectives",
    "simulated",
]
