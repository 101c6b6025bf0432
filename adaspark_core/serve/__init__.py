"""Serving requests on a Runtime: one request served (stop strings, cancellation, saving), the
serve-stdin request format and OpenAI's API. A sibling of evaluate: neither imports the other."""
