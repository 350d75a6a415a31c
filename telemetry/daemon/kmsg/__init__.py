"""The kernel-log collector's parts: record parser, classifier, burst counters, state file, follower.

`record` and `classify` are pure; `counts` is plain bookkeeping; `follower` is the only part that
touches `/dev/kmsg` and `state` the only part that touches the state directory.
"""
