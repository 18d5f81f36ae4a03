"""Torch backend (GPU parity): not built yet; see the torch parity issue."""
