"""``tensorhub bench rl``: how much less do the GPUs wait? An RL-shaped loop on
emulated hosts, each scenario's methods run in turn with the same draws.

    trainer:  step (step_s) ─ make version v available ─ step ─ ...
    rollout:  batch (lognormal, heavy tail) ─ get the newest version ─ batch ─ ...

Scenarios (``recipes/bench/scenario/*.yaml``) and their metric:

* ``standalone``: ``broadcast`` (gloo, one fixed group, every rank joins each
  step's broadcast) vs ``tensorhub`` (the trainer publishes and steps on; a
  rollout pulls the newest version when its batch is done). ``total_stall_s``.
* ``elastic``: spot rollouts are preempted in waves and replaced; ``p2p`` (every
  rollout READs the whole version from the trainer over NIXL, no server) vs
  ``tensorhub``. ``update_s`` of the joining rollouts.
* ``crossdc``: two zones joined by one slow link, the trainer in one, the
  rollouts in the other; ``broadcast`` vs ``tensorhub`` (rollouts labelled with
  their zone; the far zone's seed, a host-memory process on its own host, pulls
  each new version across once, and the rollouts move to the newest version
  their zone holds, ``Hub.latest_near``). ``rollout_stall_s``.

LoRA mode (``lora_rank > 0``, standalone and elastic; ``tensorhub.bench.rl.lora``): the
base reaches the rollouts once before the run, each step makes only an adapter
version, and the run ends once every rollout holds the last one.

Spot preemption (elastic) is a notice, then a kill at the rollout's next batch:
on its notice a ``tensorhub`` rollout withdraws what it serves first.

Output, in ``out`` (default ``bench-results/rl``): ``rl-<scenario>.json``,
``.md`` (the table) and ``.png`` (stall per step, version timeline). The JSON::

    {"benchmark": "rl", "scenario": ..., "metric": "total_stall_s" | "update_s" | "rollout_stall_s",
     "meaning": ..., "baseline": "broadcast" | "p2p", "ratio": baseline's metric / tensorhub's,
     "results": [{                        # one row per method
        "scenario", "method",
        "total_stall_s",                  # trainer + rollout stall per step, median over steps
        "rollout_stall_s", "trainer_stall_s",        # the two parts, each a median over steps
        "update_s", "joins", "join_update_s",        # elastic only: joining rollouts' update (median, count, all)
        "join_versions_behind",           # elastic only: per join, versions out by then that it lacks
        "update_s_running",               # median update of rollouts that were already running
        "stall_per_step_s", "rollout_stall_per_step_s",  # per step, in order
        "steps_s",                        # seconds from the start until the trainer's last step ended
        "batches", "mean_staleness",      # rollout batches in that time; versions behind the newest, mean
        "bytes_received", "bytes_from_trainer", "bytes_from_rollouts",  # null where unknown (gloo)
        "retries", "failed_pulls",        # pulls retried (the version was let go mid-pull...) and why
        "trainer_egress_bytes", "zone_link_bytes",   # the links' counters (null: hosts=local / one zone)
        "adapter_bytes", "trainer_egress_per_step_bytes", "egress_per_step_vs_adapter",  # LoRA mode only
        "timeline": {"trainer" | "r0" | "r0#1" ...: [[seconds, version], ...]},  # version -1: preempted
        "params": {...}}]}                # every setting that shapes the run

A stall is time a process neither computes (trainer) nor generates (rollout):
the trainer's broadcast, or its unpublish + publish; a rollout's time from
the end of a batch until it holds the new version. It counts in the step
(trainer compute to next compute) in which it starts.
"""
