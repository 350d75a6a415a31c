"""Where the memory is: the node's and each engine process's ledger, from the daemons' and hooks' /metrics.

lines (the definitions), scrape (the exporters, read through telemetry/scrape, into a report), render (the
text), cli (`memtel ledger`) and top (`memtel top`). docs/metrics.md, "Where the memory is".
"""
