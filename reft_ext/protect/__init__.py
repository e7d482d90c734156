"""Surviving a lost node: protection schemes (ARC replicas, AEC/XOR parity) and AOR."""
