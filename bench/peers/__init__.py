"""Other collective-communication systems, run on the emulated cluster for comparison."""
