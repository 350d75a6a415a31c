"""`memtel demo`: the whole A/B pipeline on one machine (stock and fixed lab servers, the daemon, the report)."""
