"""`toolkit plan`: memory per rank before a run, and what would fit."""
