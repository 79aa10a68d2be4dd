"""``tensorhub chaos``: a seeded fault campaign on emulated hosts (needs root).

* ``payload.py``  versions whose bytes any reader can check (the checker)
* ``schedule.py`` the seeded list of faults
* ``faults.py``   applying one fault to the running cluster
* ``worker.py``   a trainer rank or relaying reader process, and the driver's handle
* ``server.py``   the reference server process that can also count what it holds
* ``campaign.py`` the driver: operations with deadlines, faults, the final leak check
* ``tally.py``    what is counted, and the JSON
* ``live.py``     the live line
"""
