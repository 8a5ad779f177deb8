"""The Megatron layer: tensor-parallel linears, norms, attention, layer specs and arguments."""
