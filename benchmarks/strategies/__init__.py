"""Fault-tolerance strategies benchmark: checkpoint restart, TorchFT, tp-run (see README)."""
