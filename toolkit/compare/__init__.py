"""Strategy A/B experiments: run arms, judge equivalence, render the report."""
