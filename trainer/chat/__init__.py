"""Chat data in: conversation rows in any supported file format, the target's own chat template
and loss mask, and the ``prepare`` job that turns them into the trainer's shards."""
