"""The process a rank runs in: the process group and device (dist), stop signals, faults, exits, the console."""
