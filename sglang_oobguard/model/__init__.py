"""Model: plain data and rules that every layer reads: configuration, targets, discovery, the violation schema, the logger."""
