"""Where candidates come from: the n-gram index and fill of the request's own text, the n-gram
memory of earlier replies, and the model drafters. Imports base and engine only."""
