"""REFT extension library: snapshots, protection (ARC/AEC/AOR) and reload.

A library with small interfaces; it never imports ``megatron.training``.
"""

__version__ = "0.1.0"
