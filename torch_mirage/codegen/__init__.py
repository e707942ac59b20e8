"""Codegen: Triton source for stitch regions and μGraphs, loaded from the cache."""
