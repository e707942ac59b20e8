"""Analysis: tensor properties, device model and roofline cost model."""
