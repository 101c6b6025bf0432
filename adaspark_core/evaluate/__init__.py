"""Measuring and studying: compare (arms side by side, llama-server peers), ratios with bootstrap
intervals, replay and the hindsight account, the cost survey, test sets, trace simulation, the store
report. A sibling of serve: neither imports the other."""
