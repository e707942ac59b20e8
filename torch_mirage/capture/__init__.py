"""Capture: functional ATen graphs from Dynamo, lowered into the project IR (ops table, IR, lowering)."""
