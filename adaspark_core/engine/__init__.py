"""The models: llama.cpp targets and the DSpark forward (the only code that runs a model), the
default model, and the simulated models for tests and studies. Imports base only."""
