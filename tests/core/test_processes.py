"""Helper processes start from a fork server that has torch imported already,
and still run in the parent's environment of the moment (as spawned ones do)."""

from __future__ import annotations

import os
import sys

from tensorhub import processes


def _report(conn, *args, **kwargs) -> None:
    conn.send({"torch_already_imported": "torch" in sys.modules, "args": args, "kwargs": kwargs,
               "env": {k: os.environ.get(k) for k in ("TENSORHUB_PROCESSES_A", "TENSORHUB_PROCESSES_B")},
               "cwd": os.getcwd(), "ppid_is_parent": os.getppid() == kwargs.get("parent")})


def _fail() -> None:
    raise SystemExit(7)


def _run(target, *args, **kwargs):
    ctx = processes.context()
    here, there = ctx.Pipe()
    p = ctx.Process(target=target, args=(there, *args), kwargs=kwargs, daemon=True)
    p.start()
    assert here.poll(120), "the child did not answer"
    answer = here.recv()
    p.join(30)
    return answer, p.exitcode


def test_a_child_gets_the_parents_environment_of_the_moment_and_torch_preloaded(monkeypatch, tmp_path):
    monkeypatch.setenv("TENSORHUB_PROCESSES_A", "first")
    monkeypatch.delenv("TENSORHUB_PROCESSES_B", raising=False)
    first, code = _run(_report, 1, x=2, parent=os.getpid())
    assert code == 0
    # Not imported by _report's module: the fork server had it before the fork.
    assert first["torch_already_imported"]
    assert first["args"] == (1,) and first["kwargs"]["x"] == 2
    assert first["env"] == {"TENSORHUB_PROCESSES_A": "first", "TENSORHUB_PROCESSES_B": None}
    assert not first["ppid_is_parent"]  # forked by the fork server, not by this process

    # The fork server is running now, with the environment it started with;
    # a child made after a change still sees the change, as a spawned one would.
    monkeypatch.setenv("TENSORHUB_PROCESSES_B", "second")
    monkeypatch.delenv("TENSORHUB_PROCESSES_A")
    monkeypatch.chdir(tmp_path)
    second, code = _run(_report)
    assert code == 0
    assert second["env"] == {"TENSORHUB_PROCESSES_A": None, "TENSORHUB_PROCESSES_B": "second"}
    assert second["cwd"] == str(tmp_path)


def test_a_childs_exit_code_comes_back():
    p = processes.context().Process(target=_fail, daemon=True)
    p.start()
    p.join(60)
    assert p.exitcode == 7


def _all_reduce(conn, rank: int, world: int, dist_env: dict[str, str]) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ.update(dist_env, RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    dist.destroy_process_group()
    conn.send(total.item())


def test_ranks_meet_at_a_rendezvous_the_parent_holds():
    from tensorhub.testing import rendezvous

    ctx = processes.context()
    with rendezvous(3) as dist_env:
        # Every rank is a client, rank 0 too: nothing in a child binds a port.
        assert dist_env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and int(dist_env["MASTER_PORT"]) > 0
        pipes = [ctx.Pipe() for _ in range(3)]
        ranks = [ctx.Process(target=_all_reduce, args=(there, r, 3, dist_env), daemon=True)
                 for r, (_, there) in enumerate(pipes)]
        for p in ranks:
            p.start()
        try:
            assert all(here.poll(120) for here, _ in pipes), "a rank did not finish the all-reduce"
            assert [here.recv() for here, _ in pipes] == [6.0, 6.0, 6.0]
        finally:
            for p in ranks:
                p.join(30)
                p.kill()
