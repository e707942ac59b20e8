"""Partition: regions of the IR that a pass claims (region model, stitch partitioner)."""
