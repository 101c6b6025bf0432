"""The two online models and the width choice: FTRL/AdaGrad solvers, the verify-cost model, the
acceptance model, the chooser, and the Learners that hold them. Learners see round records only,
never llama.cpp. Imports base, candidates and store."""
