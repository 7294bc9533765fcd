"""What the ranks agree on and the one collective: the layout, the construction handshake, the
all-reduce and the packing of the reduced vector."""
