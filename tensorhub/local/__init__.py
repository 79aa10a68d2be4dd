"""A TensorHub on this machine, in OS processes: what the benchmarks, the demo
and the tests start (``tensorhub.testing`` re-exports it for tests).

    serverprocess.py  ServerProcess: ``tensorhub server`` as a subprocess on a fixed port,
                      killed and started again at the same address
    hubprocess.py     HubProcess: a Hub in its own process, driven over a pipe
    hubcalls.py       the calls a HubProcess answers (publish, pull, unpublish, ...)
    seeded.py         seeded tensors and their splits: what those calls publish and check
    ports.py          free_port, and a torch.distributed rendezvous that needs none

Children start through ``tensorhub.processes`` (a fork server that has torch imported).
"""
