"""Getting state back: choose an iteration, recover from own or peers' memory, reshard, flushed tier, rollback."""
