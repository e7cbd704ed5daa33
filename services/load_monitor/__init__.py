"""The load-monitor service: worker membership with leases and per-DP-rank load snapshots."""
