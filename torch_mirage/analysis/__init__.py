"""Analysis: tensor properties (dimension links, value properties), attention regions, device model and roofline cost
model."""
