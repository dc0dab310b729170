"""Data parallelism: the DP process group and its collectives (group.py), the DP engine's busy loop
with waves and dummy batches (engine.py), the frontend's load balancing and wave bookkeeping
(coordinator.py), and headless ranks for other machines (launch.py)."""
