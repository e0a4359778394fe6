"""The layout's per-dimension functions: parallelize.py composes tp and the data-parallel wrap in one fixed order;
context.py splits each sequence over the cp ranks and attends across them."""
