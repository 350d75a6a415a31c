"""The functions memtel run's tests hook: stand-ins for an indexer's logits call (targets memtel_run_target:*)."""


def logits(rows: int, cols: int) -> list[float]:
    return [0.0] * (rows * cols)


def scale(tensor):   # a torch tensor in, a tensor out: the record's shape is the argument's
    return tensor * 2


def device_logits(rows: int, cols: int, device):
    """A float32 [rows, cols] tensor on `device`, its pages written: what a logits launch allocates."""
    import torch

    logits = torch.empty((rows, cols), dtype=torch.float32, device=device)
    logits.fill_(1.0)
    return logits
