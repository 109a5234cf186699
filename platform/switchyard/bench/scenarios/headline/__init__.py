"""The ``headline`` scenario (issue 28), in the making: goodput at SLO on fixed capacity through a day of mixed
traffic, Switchyard against the balancers people run vLLM behind today.

Landed so far: the day of traffic (:mod:`.day`). Not registered as a ``--scenario`` until its run lands.
"""
