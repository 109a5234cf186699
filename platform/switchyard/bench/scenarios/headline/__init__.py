"""The ``headline`` scenario (issue 28): goodput at SLO on fixed capacity through a day of mixed traffic,
Switchyard against the balancers people run vLLM behind today (round-robin, least-loaded).

``day`` makes the day of requests, ``fleet`` the fleet, tenants and each arm's policy, ``scenario`` runs the
arms, ``figures`` computes the figures, goals and plot. Not among ``bench``'s defaults (about 15 minutes).
"""
