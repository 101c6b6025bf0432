"""One request decoded: arms, the round (propose, decide, verify, commit, record), and the
Runtime that owns model, learners, store and log for every command. Imports every layer below."""
