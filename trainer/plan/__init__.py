"""What a run will need before anything loads, from shapes alone (standard library only, so the
controller's preflight imports it without torch): FLOPs, each GPU's memory, the token budget,
the size of a checkpoint."""
